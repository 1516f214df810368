"""`casp prune` to a budget (issue #23's "Done when", and issue #40's: a budget may answer "just quantize"): a file
size 70 % of the dense model's f16 GGUF, swept over two ratios and two GGUF types on ptbwiki-7M; the pick, the dense
q8_0 (which beats every pruned file within the budget), read back from frontier.json and checked against the
files."""

import json
import math
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoConfig

from casp_core.artifacts.checkpoint import load_pruned
from casp_core.artifacts.gguf.writer import export_gguf, gguf_file_name
from casp_core.cli import main as cli
from casp_core.job.plan import plan_sweep
from casp_core.job.sweep.run import CANDIDATES_DIR, FRONTIER_FILE
from casp_core.settings import PruneConfig
from tests.conftest import DATASETS_DIR, PTBWIKI

CALIBRATION_FILE = DATASETS_DIR / "wikitext-2" / "wiki.valid.tokens"
SMALL_SWEEP = [
    "--ratios", "0.2,0.4", "--gguf-types", "f16,q8_0",
    "--n-samples", "8", "--seq-len", "128", "--allocation", "uniform",
    "--perplexity", "wikitext2", "--eval-seq-len", "128", "--eval-limit", "8",
    "--datasets-dir", str(DATASETS_DIR),
]  # fmt: skip


@pytest.fixture(scope="module")
def dense_f16_bytes(tmp_path_factory: pytest.TempPathFactory) -> int:
    return export_gguf(PTBWIKI, tmp_path_factory.mktemp("dense") / "dense-f16.gguf", "f16").bytes


def first_perplexity(point: dict) -> float:
    return next(iter(point["perplexity"].values()))


@pytest.mark.slow
def test_casp_prune_to_70_percent_of_the_dense_f16_gguf(
    tmp_path: Path, dense_f16_bytes: int, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = int(0.7 * dense_f16_bytes)
    out = tmp_path / "pruned"
    status = cli.main([
        "prune", "--model", str(PTBWIKI), "--out", str(out), "--target-bytes", str(budget), "--export", "gguf",
        "--calibration-data", str(CALIBRATION_FILE), *SMALL_SWEEP,
    ])  # fmt: skip
    printed = capsys.readouterr()
    assert status == 0, printed.err
    summary = json.loads(printed.out)
    frontier = json.loads((out / FRONTIER_FILE).read_text())
    assert frontier["target"] == {"max_bytes": budget, "format": "gguf", "max_params": None,
                                  "max_perplexity_increase": None, "candidates": "all"}  # fmt: skip
    candidates, pick = frontier["candidates"], frontier["pick"]
    assert summary["frontier"]["pick"] == {key: pick[key] for key in summary["frontier"]["pick"]}
    # Every (ratio, type) the estimates let in was measured, and the dense model in each type.
    dense = {(point["ratio"], point["variant"]) for point in candidates if point["dense"]}
    assert dense == {(0.0, "f16"), (0.0, "q8_0")}
    pruned = [point for point in candidates if not point["dense"]]
    settings = PruneConfig(target={"max_bytes": budget}, ratios=[0.2, 0.4], gguf_types=["f16", "q8_0"])
    estimated = list(plan_sweep(AutoConfig.from_pretrained(PTBWIKI), settings).candidates)
    assert {(point["ratio"], point["variant"]) for point in pruned} == {(c.ratio, c.variant) for c in estimated}
    for point in candidates:
        assert point["within_target"] == (point["bytes"] <= budget)
        assert 1 < first_perplexity(point) < math.inf
    # The pick: the lowest perplexity within the budget, the dense points among the candidates (the default):
    # here the dense q8_0, lower than every pruned file within the budget.
    within = [point for point in candidates if point["within_target"]]
    assert pick == min(within, key=first_perplexity) and pick["bytes"] <= budget
    assert pick in candidates and pick["dense"] and pick["variant"] == "q8_0"
    # Why, in one sentence, beside the best pruned point within the budget; in the summary printed too.
    best_pruned = min((point for point in within if not point["dense"]), key=first_perplexity)
    assert frontier["best_pruned"] == best_pruned
    assert frontier["dense_pick"] == (
        f"the dense model in q8_0 beats every pruned candidate within {budget:,} bytes of gguf: perplexity "
        f"{first_perplexity(pick):.4g} at {pick['bytes']:,} bytes; the best pruned candidate within it is ratio "
        f"{best_pruned['ratio']:g}, {best_pruned['variant']}: perplexity {first_perplexity(best_pruned):.4g} at "
        f"{best_pruned['bytes']:,} bytes"
    )
    assert summary["frontier"]["dense_pick"] == frontier["dense_pick"]
    # The Pareto front: exactly the points no other point beats in both size and perplexity.
    for point in candidates:
        beaten = any(
            other["bytes"] <= point["bytes"]
            and first_perplexity(other) <= first_perplexity(point)
            and (other["bytes"] < point["bytes"] or first_perplexity(other) < first_perplexity(point))
            for other in candidates
        )
        assert point["on_front"] == (not beaten), point
    # The files are the pick's: its GGUF (the only one, the file measured), the dense model as a checkpoint whose
    # settings are the job's (its target, nothing pruned) written as q8_0.
    gguf = out / gguf_file_name(pick["variant"])
    assert sorted(path.name for path in out.glob("*.gguf")) == [gguf.name] and pick["path"] == gguf.name
    assert gguf.stat().st_size == pick["bytes"]
    settings = json.loads((out / "config.json").read_text())["casp"]["settings"]
    assert (settings["ratio"], settings["gguf_type"], settings["target"]) == (None, "q8_0", frontier["target"])
    model, _ = load_pruned(out)
    assert sum(parameter.numel() for parameter in model.parameters()) == pick["params"]
    report = json.loads((out / "report.json").read_text())
    assert report["frontier"] == frontier and report["target_ratio"] is None and report["achieved_ratio"] == 0.0
    assert report["params"]["pruned"] == report["params"]["dense"] and report["layers"] == []
    (row,) = [row for row in report["artifacts"]["rows"] if row["format"] == "gguf"]
    assert row["bytes"] == pick["bytes"] and row["perplexity"] == pick["perplexity"]
    assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0  # llama.cpp's speed, of the pick alone
    # Nothing better to warn of: the pick is the best there is.
    assert not [warning for warning in report["warnings"] if warning.startswith("the dense model (dense, ")]
    assert "casp: warning: the dense model (dense, " not in printed.err
    # The plot, the report and the card show the sweep and say why the dense model; no per-layer plots (nothing
    # was pruned), no other candidate's files (keep "best").
    with Image.open(out / "frontier.png") as image:
        assert image.format == "PNG" and image.size[0] > 500
    assert report["plots"] == ["frontier.png"] and not (out / "plots").exists()
    for document, says in (("report.md", "- not pruned: "), ("README.md", "## Not pruned")):
        text = (out / document).read_text()
        assert "## Sweep: the candidates and the pick" in text and "![perplexity against size](frontier.png)" in text
        assert says in text and frontier["dense_pick"] in text and "- the pick: the dense model in q8_0" in text
        assert "picked by the sweep" not in text
    assert not (out / CANDIDATES_DIR).exists()
