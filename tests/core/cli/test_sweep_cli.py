"""`casp prune` to a budget (issue #23's "Done when"): a file size 70 % of the dense model's f16 GGUF, swept over
two ratios and two GGUF types on ptbwiki-7M; the pick read back from frontier.json and checked against the files."""

import json
import math
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoConfig

from casp_core.cli import main as cli
from casp_core.config import PruneConfig
from casp_core.export.gguf import export_gguf, gguf_file_name
from casp_core.sweep import CANDIDATES_DIR, FRONTIER_FILE
from casp_core.targets import sweep_candidates
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
                                  "max_perplexity_increase": None}  # fmt: skip
    candidates, pick = frontier["candidates"], frontier["pick"]
    assert summary["frontier"]["pick"] == {key: pick[key] for key in summary["frontier"]["pick"]}
    # Every (ratio, type) the estimates let in was measured, and the dense model in each type.
    dense = {(point["ratio"], point["variant"]) for point in candidates if point["dense"]}
    assert dense == {(0.0, "f16"), (0.0, "q8_0")}
    pruned = [point for point in candidates if not point["dense"]]
    settings = PruneConfig(target={"max_bytes": budget}, ratios=[0.2, 0.4], gguf_types=["f16", "q8_0"])
    estimated = sweep_candidates(AutoConfig.from_pretrained(PTBWIKI), settings)
    assert {(point["ratio"], point["variant"]) for point in pruned} == {(c.ratio, c.variant) for c in estimated}
    for point in candidates:
        assert point["within_target"] == (point["bytes"] <= budget)
        assert 1 < first_perplexity(point) < math.inf
    # The pick: the lowest perplexity among the pruned candidates within the budget.
    within = [point for point in pruned if point["within_target"]]
    assert pick == min(within, key=first_perplexity) and pick["bytes"] <= budget
    assert pick in candidates
    # The Pareto front: exactly the points no other point beats in both size and perplexity.
    for point in candidates:
        beaten = any(
            other["bytes"] <= point["bytes"]
            and first_perplexity(other) <= first_perplexity(point)
            and (other["bytes"] < point["bytes"] or first_perplexity(other) < first_perplexity(point))
            for other in candidates
        )
        assert point["on_front"] == (not beaten), point
    # The files are the pick's: its GGUF (the only one), a checkpoint of its ratio and type.
    gguf = out / gguf_file_name(pick["variant"])
    assert sorted(path.name for path in out.glob("*.gguf")) == [gguf.name] and pick["path"] == gguf.name
    assert gguf.stat().st_size == pick["bytes"]
    settings = json.loads((out / "config.json").read_text())["casp"]["settings"]
    assert (settings["ratio"], settings["gguf_type"], settings["target"]) == (pick["ratio"], pick["variant"], None)
    report = json.loads((out / "report.json").read_text())
    assert report["frontier"] == frontier and report["target_ratio"] == pick["ratio"]
    (row,) = [row for row in report["artifacts"]["rows"] if row["format"] == "gguf"]
    assert row["bytes"] == pick["bytes"] and row["perplexity"] == pick["perplexity"]
    assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0  # llama.cpp's speed, of the pick alone
    # A dense point within the budget that beats the pick is worth a warning: the user may want it instead.
    better_dense = [
        point
        for point in candidates
        if point["dense"] and point["within_target"] and first_perplexity(point) < first_perplexity(pick)
    ]
    dense_warnings = [warning for warning in report["warnings"] if warning.startswith("the dense model (dense, ")]
    assert len(dense_warnings) == (1 if better_dense else 0)
    assert any(line.startswith("casp: warning: the dense model (dense, ") for line in printed.err.splitlines()) == bool(
        better_dense
    )
    # The plot, the report and the card show the sweep; no other candidate's files stay (keep "best").
    with Image.open(out / "frontier.png") as image:
        assert image.format == "PNG" and image.size[0] > 500
    assert "frontier.png" in report["plots"]
    for document in ("report.md", "README.md"):
        text = (out / document).read_text()
        assert "## Sweep: the candidates and the pick" in text and "![perplexity against size](frontier.png)" in text
        assert f"picked by the sweep {pick['ratio']:.3f}, achieved " in text
    assert not (out / CANDIDATES_DIR).exists()
