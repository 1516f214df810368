"""Bounded host memory: a whole pruning job on a random 0.5B LLaMA written with `save_pretrained` peaks at
<= 1.3 x its weights + 1200 MiB (bench/memory.py states the margin; the 1B figure is in bench/results/memory.json)."""

from pathlib import Path

import pytest

from bench.memory import HALF_B, RSS_FACTOR, RSS_MARGIN_MIB, job_settings, measure, write_model
from tests.conftest import DATASETS_DIR, PTBWIKI


@pytest.fixture(scope="session")
def half_b_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    directory = tmp_path_factory.mktemp("memory-0.5b")
    return directory, write_model(directory, HALF_B, str(PTBWIKI.parent))


def test_job_peak_rss_is_bounded_by_the_weights(half_b_model: tuple[Path, int]) -> None:
    directory, size = half_b_model
    figures = measure(directory, job_settings(str(DATASETS_DIR)))
    size_mib = size / 2**20
    assert size_mib > 900  # the bound means something only where the weights outweigh the margin
    assert figures["peak_rss_mib"] <= RSS_FACTOR * size_mib + RSS_MARGIN_MIB, figures
