"""Plots of a well-formed report: valid PNG files that image readers open."""

import random
from pathlib import Path

import matplotlib.image
import pytest
from PIL import Image

from casp_core.report.plots import write_plots
from tests.core.eval.eval_helpers import (
    datasets_dir_or_skip,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
)
from tests.core.eval.eval_models import pruned_checkpoint

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _sublayer(rng: random.Random, units: int) -> dict:
    diagonal = rng.uniform(0.1, 10.0)
    return {
        "units": units,
        "objective": diagonal * rng.uniform(0.5, 1.0),  # the solver never does worse than the diagonal
        "diagonal_objective": diagonal,
        "offdiag_ratio": rng.uniform(0.0, 1.0),
    }


def _report(n_layers: int) -> dict:
    rng = random.Random(0)
    layers = []
    for index in range(n_layers):
        ratio = rng.uniform(0.1, 0.8)
        layers.append(
            {
                "index": index,
                "ratio": ratio,
                "sensitivity": 10 ** rng.uniform(-6, 2),
                "pruned_heads": list(range(round(8 * ratio))),
                "pruned_channels": list(range(round(172 * ratio))),
                "attn": _sublayer(rng, 8),
                "mlp": _sublayer(rng, 172),
            }
        )
    return {"settings": {"solver": "greedy"}, "layers": layers}


def _check_png(path: Path, size: tuple[int, int]) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == size
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (size[1], size[0])
    assert pixels.std() > 0  # something was drawn


def test_four_plots_are_valid_pngs(tmp_path: Path):
    paths = write_plots(_report(6), tmp_path)
    assert [p.name for p in paths] == [
        "layer_ratio.png",
        "layer_sensitivity.png",
        "offdiag_ratio.png",
        "objective_solver_vs_diagonal.png",
    ]
    assert all(p.parent == tmp_path / "plots" for p in paths)
    for path in paths[:3]:
        _check_png(path, (840, 480))  # 7 x 4 inches at 120 dpi
    _check_png(paths[3], (1320, 480))


@pytest.mark.parametrize("n_layers", [1, 32])
def test_layer_counts_from_one_to_many(tmp_path: Path, n_layers: int):
    for path in write_plots(_report(n_layers), tmp_path):
        assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_absent_figures_are_left_out_not_fatal(tmp_path: Path):
    report = _report(4)
    report["layers"][1]["sensitivity"] = 0.0  # not drawable on a log axis
    report["layers"][2]["attn"]["offdiag_ratio"] = None
    del report["layers"][3]["mlp"]
    report["layers"].reverse()  # the plots order layers by index themselves
    for path in write_plots(report, tmp_path):
        with Image.open(path) as image:
            image.verify()


def test_plots_of_a_real_pruning_report(tmp_path: Path):
    _, report = pruned_checkpoint(datasets_dir_or_skip())
    assert {"index", "ratio", "sensitivity", "attn", "mlp"} <= set(report["layers"][0])
    paths = write_plots(report, tmp_path)
    assert len(paths) == 4
    for path in paths:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(path) as image:
            image.verify()
