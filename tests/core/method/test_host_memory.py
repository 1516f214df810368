"""Host memory of whole jobs, and a 1B-class model (#15) pruned offloaded.

Host memory, a random LLaMA of about 1B parameters in bfloat16, written once with `save_pretrained`: a pruning job
without evaluation in a fresh process peaks at <= RSS_FACTOR x its weights + RSS_MARGIN_MIB. bench/memory.py states
the bound and why, and measures it on these settings and on the least-squares refit (bench/results/memory.md). The
margin is about a third of the weights: the masked and the pruned model side by side, or a second copy of the
model, do not fit under it (docs/testing.md).

Host memory, the real SmolLM2-135M from its GGUF file (#37): the whole `casp prune --ratio 0.2` at its defaults
(gradient allocation, least squares, the dense and the pruned model's perplexity in batches of 8 x 2048 tokens),
32 x 512 calibration tokens, peaks in every stage at <= 2 x the model's float32 bytes + 1.5 GB (`job_bound_mib`).

Device placement: offloaded, the same 1B model is pruned with never more than one decoder layer's weights on the
device in any stage (the CPU under another name stands in for the device: tests/core/device_placement.py).

Each takes minutes on the 2-core VM, so they are marked `slow`: `make test-slow` runs them, `make test` (CI) does
not. The memory bounds are also bench/memory.py's figures; the offloaded placement is checked on small models in
every run (tests/core/method/test_placement.py).
"""

from pathlib import Path

import pytest

from bench.memory import (
    ONE_B,
    RUNTIME_MIB,
    job_bound_mib,
    job_settings,
    measure,
    model_bytes,
    real_model_settings,
    rss_bound_mib,
    write_model,
)
from casp_core.method.prune import prune
from casp_core.model import load_model
from casp_core.settings import PruneConfig
from tests.conftest import DATASETS_DIR, PTBWIKI, SMOLLM2_GGUF
from tests.core.device_placement import OTHER_DEVICE, DevicePlacement

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_b(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """The model's folder and the MiB of its weights."""
    folder = tmp_path_factory.mktemp("one-b")
    return folder, write_model(folder, ONE_B, str(PTBWIKI.parent)) / 2**20


def test_a_1b_job_peaks_within_the_weights_once_and_a_fixed_margin(one_b: tuple[Path, float]) -> None:
    folder, weights_mib = one_b
    # A bound with room for a second copy of the weights, beside the runtime, would mean nothing.
    assert rss_bound_mib(weights_mib) < 2 * weights_mib + RUNTIME_MIB
    figures = measure(folder, job_settings(str(DATASETS_DIR)))
    assert figures["peak_rss_mib"] <= rss_bound_mib(weights_mib), figures


def test_smollm2_s_whole_prune_peaks_within_twice_the_model_and_1_5_gb_in_every_stage() -> None:
    """The evaluation's perplexity windows are cut to 16 per text for time: its batches, and so its memory, are the
    default's (8 x 2048 tokens)."""
    model_mib = model_bytes(str(SMOLLM2_GGUF)) / 2**20
    assert 510 < model_mib < 520  # 134.5 M parameters in float32
    bound = job_bound_mib(model_mib)
    figures = measure(SMOLLM2_GGUF, real_model_settings(str(DATASETS_DIR), 32, 512, evaluation_limit=16))
    stages = figures["stage_peak_rss_mib"]
    assert {"allocation", "evaluation_dense", "evaluation_pruned", "statistics", "verification"} <= set(stages)
    assert {stage: peak for stage, peak in stages.items() if peak > bound} == {}, (bound, figures)
    assert figures["peak_rss_mib"] <= bound, (bound, figures)


def test_a_1b_model_prunes_offloaded_with_one_decoder_layer_on_the_device(
    one_b: tuple[Path, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gradient allocation included: the job's settings otherwise, on the device in the offload mode."""
    model, tokenizer = load_model(str(one_b[0]))
    settings = {**job_settings(str(DATASETS_DIR)), "allocation": "gradient"}
    config = PruneConfig(**{**settings, "device": str(OTHER_DEVICE), "placement": "offload"})
    recorder = DevicePlacement(model, OTHER_DEVICE, monkeypatch)
    result = prune(model, tokenizer, config, recorder.run(), release_dense=True)
    assert recorder.offload_violations() == []
    assert {"allocation", "statistics", "calibration_forward", "verification"} <= recorder.stages_with_runs()
    runs = [snapshot.layer for snapshot in recorder.snapshots if snapshot.event == "run"]
    assert set(runs) == set(range(ONE_B["layers"]))
    assert result.placement is not None and result.placement.mode == "offload"
    assert 0 < result.params_pruned < result.params_dense
