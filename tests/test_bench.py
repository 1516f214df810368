"""The bench scripts in a tiny mode: they run, write the documented schema, and every number is finite.

The runs are `slow` (`make test-slow`): they check the benches' harness on the toy models, whose numbers casp no
longer publishes; the renderings from stored rows stay in `make test`."""

import json
import math
from pathlib import Path

import pytest
import torch

from bench import (
    device_memory,
    engines,
    frontier,
    kept_scores,
    load,
    quality,
    quantized,
    recovery,
    smollm2,
    speed,
    sweep,
    zero_shot_scorer,
)
from bench.common import all_finite, default_datasets_dir, default_models_dir
from casp_core.settings import PruneConfig
from tests.conftest import STORIES

pytestmark = pytest.mark.skipif(
    not (Path(default_models_dir()) / "stories260K").is_dir() or not Path(default_datasets_dir()).is_dir(),
    reason="needs the shared fixtures (models and data sets)",
)

ROW_FIELDS = {
    "model", "ratio", "solver", "allocation", "alpha", "calibration_mode", "n_samples", "seq_len", "seed",
    "ppl", "objective", "achieved_ratio", "seconds",
}  # fmt: skip


@pytest.mark.slow
def test_quality_tiny(tmp_path: Path) -> None:
    payload = quality.main(
        ["--models", "stories260K", "--ratios", "0.3", "--solvers", "greedy", "diagonal", "--allocations",
         "gradient", "--alphas", "auto", "--modes", "dense", "--compensation-ratios", "0.3",
         "--compensation-solvers", "greedy", "--shape-ratios", "0.3", "--rounding-ratios", "0.3", "--roundings", "8",
         "--zero-shot", "piqa", "--zero-shot-limit", "4", "--n-samples", "4",
         "--seq-len", "32", "--eval-windows", "2", "--eval-seq-len", "32", "--jobs", "1", "--out", str(tmp_path)]
    )  # fmt: skip
    written = json.loads((tmp_path / "quality.json").read_text())
    assert written == json.loads(json.dumps(payload))
    assert {"rows", "machine", "settings"} <= set(written)
    # greedy and diagonal (sequential), greedy with alpha auto, greedy with dense calibration, and that one again
    # with compensation; greedy with uniform allocation and with the uniform shape; the rounding study's greedy with
    # compensation (sequential) at auto's multiple (1 for 172 channels) and 8
    assert len(written["rows"]) == 9
    uniform = quality._one(written["rows"], shape="uniform")
    assert len(uniform["layer_shapes"]) == 1 and "shape" in uniform["studies"]
    per_layer = quality._one(written["rows"], allocation="gradient", solver="greedy", compensation="none", alpha=1.0)
    assert len(per_layer["layer_shapes"]) > 1
    rounding = [row for row in written["rows"] if "rounding" in row["studies"]]
    assert sorted((row["ffn_multiple"], row["round_to"]) for row in rounding) == [(1, "auto"), (8, 8)]
    # a layer the allocation spares keeps its 172 channels; the others keep multiples of 8
    assert all(width % 8 == 0 or width == 172 for width in quality._one(rounding, round_to=8)["ffn_widths"])
    assert "(8) The price of rounding" in (tmp_path / "quality.md").read_text()
    for row in written["rows"]:
        assert set(row) >= ROW_FIELDS | {"round_to", "ffn_multiple", "ffn_widths"}
        assert set(row["ppl"]) == {"wikitext2", "ptb"}
        assert abs(row["achieved_ratio"] - 0.3) <= 0.01
    greedy = quality._one(written["rows"], solver="greedy", calibration_mode="sequential")
    assert greedy is not None and greedy["objective"] <= greedy["diagonal_objective"] * (1 + 1e-9)
    compensated = quality._one(written["rows"], compensation="least_squares")
    assert compensated is not None and compensated["calibration_mode"] == "dense"
    # Zero-shot on the compensation study's greedy rows (over 4 documents: multiples of 1/4) and the dense model.
    for figures in (compensated["zero_shot"], written["dense"][0]["zero_shot"]):
        assert set(figures) == {"piqa", "mean"} and figures["piqa"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert greedy["zero_shot"] is None  # not in the compensation study
    assert all_finite(written)
    assert "## Claims" in (tmp_path / "quality.md").read_text()
    assert "(6) Least-squares compensation" in (tmp_path / "quality.md").read_text()
    assert "Least squares has the higher mean in" in (tmp_path / "quality.md").read_text()
    assert "(7) The price of the uniform shape" in (tmp_path / "quality.md").read_text()
    automatic = quality._one(written["rows"], alpha="auto")
    assert automatic is not None and len(automatic["alpha_auto"]["grid"]) == 6
    chosen = automatic["alpha_auto"]["chosen"]
    assert f"| stories260K | 0.3 | {chosen:g} | " in (tmp_path / "quality.md").read_text()


@pytest.mark.slow
def test_quality_merge_adds_new_rows_and_reruns_stored_ones_as_a_check(tmp_path: Path) -> None:
    """Only FLAP's rows of the compensation study, then its bias rows merged into that result."""
    tiny = ["--models", "stories260K", "--ratios", "--alphas", "--modes", "dense", "--compensation-ratios", "0.3",
            "--compensation-solvers", "flap", "--n-samples", "4", "--seq-len", "32", "--eval-windows", "2",
            "--eval-seq-len", "32", "--shape-ratios", "--rounding-ratios", "--jobs", "1"]  # fmt: skip
    first = quality.main([*tiny, "--compensations", "none", "--out", str(tmp_path / "first")])
    assert [row["compensation"] for row in first["rows"]] == ["none"]
    merged = quality.main(
        [*tiny, "--compensations", "none", "bias", "--merge", str(tmp_path / "first" / "quality.json"),
         "--out", str(tmp_path / "merged")]
    )  # fmt: skip
    assert json.loads((tmp_path / "merged" / "quality.json").read_text()) == json.loads(json.dumps(merged))
    assert [(row["compensation"], row.get("merged_run")) for row in merged["rows"]] == [("bias", 0), ("none", None)]
    assert merged["machine"] == first["machine"]  # the stored rows keep the run they came from
    run = merged["merged_runs"][0]
    assert (run["rows_added"], run["rows_rerun"]) == (1, 1) and run["rerun_max_relative_ppl_difference"] <= 1e-12
    assert run["machine"]["git_commit"] == first["machine"]["git_commit"] and "--merge" in run["command"]
    markdown = (tmp_path / "merged" / "quality.md").read_text()
    assert "Rows with `merged_run` 0 (1 added, 1 rerun as a check" in markdown
    assert "FLAP + its bias against FLAP without compensation" in markdown
    other = {**first, "settings": {**first["settings"], "n_samples": 8}}
    with pytest.raises(SystemExit, match=r"--merge: the earlier result has other settings \(n_samples\)"):
        quality.merge(other, first, [])


@pytest.mark.slow
def test_recovery_tiny(tmp_path: Path) -> None:
    payload = recovery.main(
        ["--models", "stories260K", "--ratios", "0.5", "--recipes", "cross_entropy+lora", "distill+full",
         "--steps", "2", "--batch-size", "2", "--eval-windows", "2", "--train-lines", "20",
         "--zero-shot", "piqa", "--zero-shot-limit", "4", "--out", str(tmp_path)]
    )  # fmt: skip
    written = json.loads((tmp_path / "recovery.json").read_text())
    assert written == json.loads(json.dumps(payload))
    assert [row["recipe"] for row in written["rows"]] == ["cross_entropy+lora", "distill+full"]
    for row in written["rows"]:
        assert (
            set(row["recovered"]["perplexity"]) == {"wikitext2", "ptb"}
            and 0 <= row["recovered"]["zero_shot_average"] <= 1
        )
        assert row["recovery"]["steps"] == 2 and row["recovery"]["tokens"] == 2 * 2 * recovery.SEQ_LEN
    assert (
        written["rows"][1]["recovery"]["teacher"]["top_k"] == 64 and written["rows"][0]["recovery"]["teacher"] is None
    )
    assert all_finite(written)
    assert "| stories260K | 0.5 | distill+full |" in (tmp_path / "recovery.md").read_text()


@pytest.mark.slow
def test_speed_tiny(tmp_path: Path) -> None:
    payload = speed.main(
        ["--sizes", "128x1x256", "--n-samples", "2", "--seq-len", "16", "--batch-size", "1", "--repeats", "1",
         "--greedy-d", "256", "--greedy-repeats", "1", "--memory-size", "128x1x256", "--memory-batches", "1", "2",
         "--in-process", "--out", str(tmp_path)]
    )  # fmt: skip
    written = json.loads((tmp_path / "speed.json").read_text())
    assert {"sizes", "greedy_at_scale", "calibration_memory", "gpu", "machine", "settings"} <= set(written)
    stages = written["sizes"][0]["stages"]
    assert set(stages) == set(speed.STAGE_BASELINES)
    for stage in stages.values():
        assert stage["seconds"] > 0 and math.isfinite(stage["ratio_to_baseline"])
    assert written["gpu"]["measured"] is False
    assert written["greedy_at_scale"]["d"] == 256
    assert all_finite(written) and payload["settings"]["n_samples"] == 2
    assert "not measured" in (tmp_path / "speed.md").read_text()


@pytest.mark.slow
def test_engines_quick(tmp_path: Path) -> None:
    payload = engines.main(["--quick", "--work", str(tmp_path / "work"), "--out", str(tmp_path)])
    written = json.loads((tmp_path / "engines.json").read_text())
    assert written == json.loads(json.dumps(payload))
    assert {"rows", "variants", "gpu", "machine", "settings"} <= set(written)
    assert written["gpu"]["measured"] is False and "No GPU" in written["gpu"]["reason"]
    assert {"loadavg_start", "loadavg_end", "cpu_model", "git_commit", "date", "nproc"} <= set(written["machine"])
    assert written["settings"]["threads"] >= 1 and written["settings"]["prompt_tokens"] == 32
    # dense and 0.5 under round_to 1 and auto, each timed in both engines
    assert [(row["engine"], row["variant"]) for row in written["rows"]] == [
        (engine, variant) for engine in engines.ENGINES for variant in ("dense", "0.5 round_to 1", "0.5 round_to auto")
    ]
    dense = written["variants"][0]
    for variant in written["variants"][1:]:
        assert abs(variant["achieved_ratio"] - 0.5) <= 0.05
        assert variant["decoder_parameters"] < dense["decoder_parameters"]
        assert max(variant["ffn_widths"]) <= 256 and len(variant["ffn_widths"]) == 2
    for row in written["rows"]:
        for phase in engines.PHASES:
            figures = row[phase]
            assert figures["tokens_per_second"] > 0 and len(figures["seconds"]) == 1
        if row["variant"] == "dense":
            assert row["goal_speedup"] is None and row["prefill"]["meets_goal"] is None
        else:
            assert row["goal_speedup"] == pytest.approx(0.9 * row["parameter_ratio"])
            assert row["decode"]["meets_goal"] == (row["decode"]["speedup"] >= row["goal_speedup"])
    assert all_finite(written)
    markdown = (tmp_path / "engines.md").read_text()
    assert "| llama.cpp | 0.5 round_to auto |" in markdown and "No GPU was lent" in markdown
    assert written["settings"]["reused_checkpoints"] == []
    # Timed again from the same --work: nothing pruned again, the same models.
    again = engines.main(["--quick", "--work", str(tmp_path / "work"), "--repeats", "2", "--out", str(tmp_path / "b")])
    assert again["settings"]["reused_checkpoints"] == ["dense", "0.5 round_to 1", "0.5 round_to auto"]
    assert again["variants"] == written["variants"] and len(again["rows"][0]["decode"]["seconds"]) == 2


@pytest.mark.slow
def test_load_tiny(tmp_path: Path) -> None:
    payload = load.main(
        ["--modes", "embedded", "--jobs", "6", "--polls", "10", "--concurrency", "2", "--out", str(tmp_path)]
    )
    written = json.loads((tmp_path / "load.json").read_text())
    assert written == json.loads(json.dumps(payload))
    embedded = written["modes"]["embedded"]
    pairs, polls = embedded["submit_cancel"], embedded["status"]
    assert (pairs["errors"], polls["errors"]) == (0, 0)
    assert pairs["statuses_after_cancel"] == {"cancelled": 6}
    assert pairs["pairs_per_second"] > 0 and polls["polls_per_second"] > 0
    for latency in (pairs["latency_ms"]["submit"], pairs["latency_ms"]["cancel"], polls["latency_ms"]):
        assert 0 < latency["p50"] <= latency["p99"] <= latency["max"]
    assert {"loadavg_start", "loadavg_end", "git_commit"} <= set(written["machine"])
    assert all_finite(written)
    assert "| embedded | sqlite |" in (tmp_path / "load.md").read_text()


@pytest.mark.slow
def test_device_memory(tmp_path: Path) -> None:
    payload = device_memory.main(["--out", str(tmp_path)])
    written = json.loads((tmp_path / "device_memory.json").read_text())
    assert written == json.loads(json.dumps(payload)) and all_finite(written)
    assert written["measured"] is False and "not checked against a GPU measurement" in written["note"]
    rows = {(row["model"], row["job"]): row for row in written["rows"]}
    assert len(rows) == 12  # four dense shapes and two mixtures of experts, each at batch 8 and 1
    llama2_70b = rows[("Llama-2-70B", "128 x 2048, batch 8")]
    # 80 layers of 1.59 GiB, and the offloaded peak far below the device while the resident one is beyond it.
    assert llama2_70b["layer_weights"] == pytest.approx(1.59, abs=0.01)
    assert llama2_70b["offload_peak"] < 40 < 80 < llama2_70b["resident_peak"]
    assert llama2_70b["on_80_gib"] == "offload"
    recovery_rows = {(row["model"], row["recovery"]): row for row in written["recovery_rows"]}
    # 70B pruned by half recovers with LoRA and checkpointing on one 80 GiB device, never by full fine-tuning.
    assert recovery_rows[("Llama-2-70B", "lora, cross_entropy, checkpointing")]["fits_80_gib"]
    assert not recovery_rows[("Llama-2-70B", "full, distill, batch 1")]["fits_80_gib"]
    assert "## Recovery after pruning by 50%" in (tmp_path / "device_memory.md").read_text()
    assert rows[("LLaMA2-7B", "128 x 2048, batch 8")]["on_80_gib"] == "resident"
    assert "**Not yet checked against a GPU measurement" in (tmp_path / "device_memory.md").read_text()


@pytest.mark.slow
def test_quantized_tiny(tmp_path: Path) -> None:
    """stories260K dense and pruned at 0.3 (the 32-block family: its hidden size 64 refuses the K-quants), and the
    speed part on a 2-layer LLaMA at ratios 0 and 0.5."""
    payload = quantized.main(
        ["--models", "stories260K", "--ratios", "0", "0.3", "--n-samples", "4", "--seq-len", "32",
         "--eval-windows", "2", "--eval-seq-len", "32", "--speed-ratios", "0", "0.5", "--speed-types", "f16", "q8_0",
         "--speed-hidden-size", "256", "--speed-num-hidden-layers", "2", "--speed-intermediate-size", "1024",
         "--speed-num-attention-heads", "4", "--speed-num-key-value-heads", "2", "--speed-vocab-size", "4096",
         "--out", str(tmp_path)]
    )  # fmt: skip
    written = json.loads((tmp_path / "quantized.json").read_text())
    assert written == json.loads(json.dumps(payload))
    assert all_finite(written) and {"machine", "settings", "rows", "equal_bytes", "speed", "total_seconds"} <= set(
        written
    )
    assert [(row["ratio"], row["type"]) for row in written["rows"]] == [
        (0.0, "f16"), (0.0, "q8_0"), (0.0, "q4_0"), (0.3, "f16"), (0.3, "q8_0"), (0.3, "q4_0")
    ]  # fmt: skip
    by = {(row["ratio"], row["type"]): row for row in written["rows"]}
    # The dense ffn_down rows (172) fit no 32-block type: llama.cpp keeps them F16, and the row names them.
    dense_q8 = by[(0.0, "q8_0")]
    assert {(f["type"], f["row_length"]) for f in dense_q8["fallbacks"]} == {("F16", 172)}
    assert len(dense_q8["fallbacks"]) == 5 and "5 x ffn_down: F16" in quantized._fallback_summary(dense_q8["fallbacks"])
    # Pruned for q8_0: every FFN width of 64 channels or more a multiple of 32, so no ffn_down falls back.
    pruned_q8 = by[(0.3, "q8_0")]
    assert all(width % 32 == 0 for width in pruned_q8["ffn_widths"] if width >= 64)
    assert not [f for f in pruned_q8["fallbacks"] if "ffn_down" in f["tensor"]]
    assert abs(pruned_q8["achieved_ratio"] - 0.3) <= 0.05
    for row in written["rows"]:
        assert row["bytes"] > 0 and row["ppl_in"] == "llama.cpp"
        assert (
            by[(row["ratio"], "f16")]["bytes"]
            > by[(row["ratio"], "q8_0")]["bytes"]
            > by[(row["ratio"], "q4_0")]["bytes"]
        )
    # f16 in llama.cpp against the float32 checkpoint in transformers, on the same windows.
    for ratio in (0.0, 0.3):
        f16 = by[(ratio, "f16")]
        for name, value in f16["ppl"].items():
            assert abs(value / f16["ppl_transformers"][name] - 1) < 0.01
    # The speed model at 0.5: the uniform shape's heads and whole blocks of 256 FFN channels.
    speed = {(row["ratio"], row["type"]): row for row in written["speed"]}
    assert (speed[(0.5, "q8_0")]["heads"], speed[(0.5, "q8_0")]["ffn_width"]) == (2, 512)
    assert speed[(0.0, "f16")]["ffn_width"] == 1024 and speed[(0.5, "f16")]["bytes"] < speed[(0.0, "f16")]["bytes"]
    assert all(row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0 for row in written["speed"])
    comparison = next(c for c in written["equal_bytes"] if c["type"] == "f16")
    assert (
        comparison["change"]["wikitext2"]
        == comparison["ppl"]["wikitext2"] / comparison["dense_ppl_at_bytes"]["wikitext2"] - 1
    )
    markdown = (tmp_path / "quantized.md").read_text()
    assert "## The answer" in markdown and "## Speed" in markdown and (tmp_path / "quantized.png").stat().st_size > 0
    # --quality-from keeps the quality rows and their run's machine; no speed ratios, no speed rows.
    kept = quantized.main(
        ["--quality-from", str(tmp_path / "quantized.json"), "--speed-ratios", "--out", str(tmp_path / "kept")]
    )
    assert kept["rows"] == written["rows"] and kept["quality_machine"] == written["machine"] and kept["speed"] == []
    assert (
        kept["settings"]["eval_windows"] == 2
        and "kept from an earlier run" in (tmp_path / "kept" / "quantized.md").read_text()
    )


def test_quantized_dense_perplexity_at_equal_bytes_is_interpolated_in_log_bytes() -> None:
    dense = [{"bytes": 100, "ppl": {"wikitext2": 20.0}}, {"bytes": 10_000, "ppl": {"wikitext2": 10.0}}]
    assert quantized._dense_at(dense, 1_000, "wikitext2") == pytest.approx(15.0)
    assert quantized._dense_at(dense, 100, "wikitext2") == 20.0
    assert (
        quantized._dense_at(dense, 99, "wikitext2") is None and quantized._dense_at(dense, 10_001, "wikitext2") is None
    )


@pytest.mark.slow
def test_sweep_tiny(tmp_path: Path) -> None:
    """ptbwiki-7M in dense mode at two ratios on 4 x 32 tokens, one single prune timed (so k separate prunes are
    an estimate): three fresh processes."""
    payload = sweep.main(
        ["--models", "ptbwiki-7M", "--modes", "dense", "--ratios", "0.2", "0.5", "--single-ratios",
         "ptbwiki-7M=0.2", "--n-samples", "4", "--seq-len", "32", "--out", str(tmp_path)]
    )  # fmt: skip
    written = json.loads((tmp_path / "sweep.json").read_text())
    assert written == json.loads(json.dumps(payload)) and all_finite(written)
    (result,) = written["results"]
    comparison, measured = result["comparison"], result["sweep"]
    assert [entry["ratio"] for entry in measured["per_ratio"]] == [0.2, 0.5]
    assert all(abs(entry["achieved_ratio"] - entry["ratio"]) <= 0.01 for entry in measured["per_ratio"])
    # Dense mode: the statistics are shared work, the solver and the verification each ratio's own.
    assert {"allocation", "statistics"} <= set(measured["shared_stage_seconds"])
    assert "statistics" not in comparison["per_ratio_stage_seconds"]
    assert {"solver", "verification"} <= set(comparison["per_ratio_stage_seconds"])
    (single,) = result["singles"]
    assert comparison["sweep_in_singles"] == measured["seconds"] / single["seconds"]
    assert comparison["separate_estimated"] and comparison["separate_seconds"] == 2 * single["seconds"]
    assert comparison["goal_in_singles"] == 1.35 and comparison["goal_met"] == (comparison["sweep_in_singles"] <= 1.35)
    assert measured["peak_rss_mib"] >= measured["loaded_rss_mib"] > 0
    markdown = (tmp_path / "sweep.md").read_text()
    assert "| ptbwiki-7M | dense | least_squares | 2 |" in markdown and "## Where the time goes" in markdown
    assert ("met." if comparison["goal_met"] else "**not met**.") in markdown.split("## The goal")[1]
    # --render writes the same markdown from the JSON alone.
    sweep.main(["--render", str(tmp_path / "sweep.json"), "--out", str(tmp_path / "rendered")])
    assert (tmp_path / "rendered" / "sweep.md").read_text() == markdown
    # Each row says when and under what load it was measured; a later run into the same folder keeps the rows it
    # does not measure again (here, as if it ran sequential mode only) and replaces the one it does.
    assert len(measured["loadavg"]) == len(single["loadavg"]) == 2
    assert f"{written['machine']['date'][:16]}, {written['machine']['git_commit'][:10]}, load up to" in markdown
    assert sweep._earlier_results(tmp_path / "sweep.json", [("ptbwiki-7M", "dense", "least_squares")]) == []
    (kept,) = sweep._earlier_results(tmp_path / "sweep.json", [("ptbwiki-7M", "sequential", "least_squares")])
    assert kept == result and kept["measured"]["machine"]["date"] == written["machine"]["date"]


@pytest.mark.slow
def test_frontier_tiny(tmp_path: Path) -> None:
    """stories260K at two ratios in f16 and q8_0 on 4 x 128 calibration tokens and 4 evaluation windows."""
    payload = frontier.main(
        ["--models", "stories260K", "--ratios", "0.3", "0.5", "--gguf-types", "f16", "q8_0", "--n-samples", "4",
         "--eval-windows", "4", "--out", str(tmp_path)]
    )  # fmt: skip
    written = json.loads((tmp_path / "frontier.json").read_text())
    assert written == json.loads(json.dumps(payload)) and all_finite(written)
    (run,) = written["models"]
    points = run["frontier"]["candidates"]
    assert {(point["ratio"], point["variant"]) for point in points} == {
        (ratio, variant) for ratio in (0.0, 0.3, 0.5) for variant in ("f16", "q8_0")
    }
    assert set(points[0]["perplexity"]) == {"wikitext2", "ptb:test"}
    # The budget applied to the measured points: the pick is the best file within 70 % of dense f16, the
    # dense ones included (target.candidates all, the default), and the best pruned one is beside it.
    dense_f16 = next(point for point in points if point["dense"] and point["variant"] == "f16")
    budget = run["budget"]
    assert budget["max_bytes"] == int(0.7 * dense_f16["bytes"])
    within = [p for p in points if p["bytes"] <= budget["max_bytes"]]
    assert budget["pick"] == min(within, key=lambda point: point["perplexity"]["wikitext2"])
    pruned = [p for p in within if not p["dense"]]
    assert budget["best_pruned"] == min(pruned, key=lambda point: point["perplexity"]["wikitext2"])
    beaten = frontier.dense_beats(points)
    assert all(dense["bytes"] <= point["bytes"] for point, dense in beaten)
    markdown = (tmp_path / "frontier.md").read_text()
    assert f"- A dense file beats {len(beaten)} of the 4 pruned points" in markdown
    assert (tmp_path / "frontier-stories260K.png").stat().st_size > 0


def test_smollm2_renders_where_the_defaults_lose_and_which_files_are_on_the_front(tmp_path: Path) -> None:
    """bench.smollm2's tables from rows of the shape its children write (its measurements take hours: not here)."""
    columns = ("wikitext2@128", "ptb:test@128", "wikitext2@2048", "ptb:test@2048")
    machine = {"date": "2026-11-28", "cpu_model": "a CPU", "nproc": 2, "torch": "2.13.0", "torch_threads": 2}
    machine |= {"git_commit": "aaaaaaaaaa", "transformers": "5.24.0"}
    machine |= {"loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [1.5, 1.0, 1.0]}
    settings = {"windows": {"128": 4, "2048": 1}, "zero_shot_limit": -1}

    def quality_row(key: str, ppl: tuple[float, ...]) -> dict:
        figures = {"prune_seconds": 60.0, "prune_peak_rss_mib": 1500.0, "zero_shot": None}
        return {
            "key": key,
            "settings": settings,
            "machine": machine,
            "ppl": dict(zip(columns, ppl, strict=True)),
            **figures,
        }

    def speed(size: int) -> dict:
        figures = {"prefill": 100.0 * 270e6 / size, "decode": 10.0 * 270e6 / size}  # as fast as it is small
        return {"1": figures, "2": figures}

    def gguf_file(gguf_type: str, size: int, ppl: float) -> dict:
        figures = {"bits_per_weight": 8 * size / 135e6, "tokens_per_s": speed(size)}
        return {"type": gguf_type, "bytes": size, "ppl": dict.fromkeys(columns, ppl), **figures}

    rows = [
        {"key": smollm2.SENSITIVITIES_ROW, "settings": settings, "machine": machine, "seconds": 240.0}
        | {"peak_rss_mib": 1400.0, "sensitivities": [0.1] * 30},
        quality_row("quality/dense/0", (20.0, 30.0, 15.0, 25.0)),
        quality_row("quality/defaults/0.2", (30.0, 45.0, 22.0, 35.0)),
        quality_row("quality/solver wanda_sp/0.2", (31.0, 44.0, 23.0, 36.0)),
        quality_row("quality/alpha auto/0.2", (32.0, 46.0, 23.0, 36.0)),  # measured before the choice was recorded
        *(  # the zero-shot part's rows, a task each: the dense model's seven, two of the defaults', diagonal's five
            {"key": f"zero-shot/{model}/{task}", "settings": settings, "machine": machine, "prune_seconds": 0.0}
            | {"evaluation_seconds": 60.0, "zero_shot": {"acc": {task: accuracy}, "mean": accuracy}}
            for model, tasks in (
                ("defaults/0.2", ("piqa", "boolq")),
                ("dense/0", tuple(task for task in smollm2.ZERO_SHOT_TASKS if task != "hellaswag")),
                ("solver diagonal/0.2", ("openbookqa", "winogrande", "piqa", "arc_challenge", "arc_easy")),
            )
            for task in tasks
            for accuracy in [{"boolq": 0.5, "openbookqa": 0.25}.get(task, 0.625) if model == "dense/0" else 0.625]
        ),
        *(  # hellaswag in its eight parts: the dense model's all (half at 0.5, half at 0.75), the defaults' three
            {"key": f"zero-shot/{model}/{part}", "settings": settings, "machine": machine, "prune_seconds": 0.0}
            | {"evaluation_seconds": 1200.0}
            | {"zero_shot": {"acc": {"hellaswag": accuracy}, "n_samples": {"hellaswag": 1255}}}
            for model, parts in (("dense/0", 8), ("defaults/0.2", 3))
            for number, part in enumerate(smollm2.measured_tasks("hellaswag")[:parts])
            for accuracy in [0.5 if number < 4 else 0.75]
        ),
        *(  # rows that record their documents, as the part's rows do since stop 58
            {"key": f"zero-shot/solver wanda_sp/0.2/{task}", "settings": settings, "machine": machine}
            | {"prune_seconds": 0.0, "evaluation_seconds": 60.0}
            | {"zero_shot": {"acc": {task: accuracy}, "n_samples": {task: documents}}}
            for task, accuracy, documents in (("piqa", 0.58, 1838), ("boolq", 0.605, 3270))
        ),
        {"key": "ladder/0/dense", "settings": settings, "machine": machine, "files": [
            gguf_file("f16", 270_000_000, 15.0), gguf_file("q8_0", 145_000_000, 15.1),
            gguf_file("q4_k_m", 105_000_000, 16.0),
        ]},
        {"key": "ladder/0.2/q4_k_m", "settings": settings, "machine": machine, "files": [
            gguf_file("q5_k_m", 100_000_000, 21.0),  # measured before the dense file was timed beside
            gguf_file("q4_k_m", 90_000_000, 22.0) | {"dense_tokens_per_s": speed(120_000_000)},  # a slower day
        ]},
    ]  # fmt: skip
    # Rows that record their prune: one as its key prunes now, one from before a default changed.
    recorded = settings | {"datasets_dir": str(tmp_path)}
    for row in rows[2:4]:
        row |= {"settings": recorded, "prune": smollm2.prune_record(recorded, row["key"])}
    rows[3]["prune"] = rows[3]["prune"] | {"alpha": 1.0, "round_to": 8}
    rerun = quality_row("quality/alpha auto/0.2", (32.0, 46.0, 23.0, 36.0)) | {"alpha_auto": {"chosen": 0.5}}
    # A rerun of the prune the held row no longer records: not set against it.
    other_prune = quality_row("quality/solver wanda_sp/0.2", (31.0, 44.0, 23.0, 36.0)) | {"prune": rows[2]["prune"]}
    # A zero-shot row measured again at another commit (the scorer changed between them), one document apart.
    zero_shot_rerun = next(row for row in rows if row["key"] == "zero-shot/solver wanda_sp/0.2/piqa") | {
        "machine": machine | {"git_commit": "bbbbbbbbbb"},
        "zero_shot": {"acc": {"piqa": 0.58 + 1 / 1838}, "n_samples": {"piqa": 1838}},
    }
    smollm2.render({"rows": rows, "reruns": [rerun, other_prune, zero_shot_rerun]}, tmp_path)
    markdown = (tmp_path / "smollm2.md").read_text()
    assert "| 0.2 | alpha auto (chose 0.5) | 32.00 |" in markdown  # the choice its rerun recorded
    assert "| quality/alpha auto/0.2 wikitext2@128 | 32.00 | 32.00 | +0.00% |" in markdown
    assert "| quality/solver wanda_sp/0.2 wikitext2@128" not in markdown
    assert "| zero-shot/solver wanda_sp/0.2/piqa | 0.5800 (aaaaaaa) | 0.5805 (bbbbbbb) | +0.05 |" in markdown
    assert "The gradient sensitivities S_l on the calibration windows took 240 s (peak RSS 1400 MiB" in markdown
    assert "| solver wanda_sp | +4.5% / +2.9% | 3 of 4 |" in markdown  # 23/22 and 36/35 at 2048; loses ptb:test@128
    assert "| defaults | 22.00 / 35.00 |  |" in markdown
    assert "| allocation uniform | - |  |" in markdown  # not measured
    assert "Where the defaults lose:" in markdown
    assert "- at 0.2, solver wanda_sp beats the defaults on ptb:test@128: 44.00 against 45.00 (-2.2%)" in markdown
    assert markdown.count("beats the defaults") == 1
    front = {line.split(" |")[0] for line in markdown.splitlines() if line.startswith("| ") and "| yes |" in line}
    # Both pruned files are smaller than every dense one, so nothing beats them in both bytes and perplexity.
    assert front == {"| dense f16", "| dense q8_0", "| dense q4_k_m", "| pruned 0.2 q5_k_m", "| pruned 0.2 q4_k_m"}
    assert "| pruned 0.2 q4_k_m | 90,000,000 | outside the dense range |" in markdown
    held = markdown.split("Held from before casp's defaults changed")[1].split("\n## ")[0]
    assert "- `quality/solver wanda_sp/0.2`: alpha 1.0 (now 0.5), round_to 8 (now auto)" in held
    assert "defaults" not in held
    # The pruned q4_k_m against the dense q4_k_m timed beside it; no dense file was timed beside the pruned q5_k_m.
    assert "| pruned 0.2 q4_k_m | 1.33x | 1.33x | 1.33x | 1.33x |" in markdown  # not 1.17x, the dense row's
    assert "| pruned 0.2 q5_k_m |" not in markdown.split("### Speed against dense at the same type")[1]
    assert (tmp_path / "smollm2.png").stat().st_size > 0
    # The full zero-shot rows in a table of their own, the dense one first; no quality row measured the tasks.
    every_document = markdown.split("### Zero-shot accuracy, every document")[1].split("\n## ")[0].splitlines()
    # The dense model's means over its seven tasks (boolq 0.5, openbookqa 0.25, the others 0.625) and over the first
    # five; the defaults' two tasks, no mean; the diagonal selection's first five, their mean alone.
    assert every_document[4:9] == [
        f"| 0 | dense | 0.500 |{' 0.625 |' * 5} 0.250 | 0.554 | 0.550 |",
        "| 0.2 | defaults | 0.625 | 0.625 | - | - | - | - | - | - | - |",
        "| 0.2 | solver diagonal | - | 0.625 | - | 0.625 | 0.625 | 0.625 | 0.625 | - | 0.625 |",
        "| 0.2 | solver wanda_sp | 0.605 | 0.580 | - | - | - | - | - | - | - |",
        "",
    ]
    # Against the defaults where a document count is known (piqa, boolq): diagonal's piqa ties; wanda_sp's piqa is
    # 4.5 points down, sqrt(0.625 * 0.375 / 1837) and sqrt(0.58 * 0.42 / 1837) combined: 2.8 standard errors; its
    # boolq, 2.0 points down over 3270 documents (1.7 standard errors), is not named.
    differences = markdown.split("### Zero-shot: where a configuration differs from the defaults")[1].split("\n### ")[0]
    assert "Of the 3 (configuration, ratio, task) accuracies measured on every document" in differences
    assert "- at 0.2, solver wanda_sp on piqa: 0.580 against 0.625 (-4.5 points, 2.8 standard errors)" in differences
    assert differences.count("\n- ") == 1
    assert "26 of 294 rows measured; 268 left" in markdown
    assert "Zero-shot accuracy, the first" not in markdown
    assert next(smollm2.planned_rows(["ladder"], [0.2])) == smollm2.SENSITIVITIES_ROW
    planned = list(smollm2.planned_rows(["zero-shot"], [0.1, 0.2]))
    assert planned[:3] == [smollm2.SENSITIVITIES_ROW, "zero-shot/dense/0/openbookqa", "zero-shot/dense/0/winogrande"]
    assert planned[7:10] == [f"zero-shot/dense/0/hellaswag (part {part} of 8)" for part in (1, 2, 3)]
    assert planned[15] == "zero-shot/defaults/0.2/openbookqa"
    # 0.1 is not among the ratios the tasks are measured at; hellaswag's eight parts are a row each.
    assert len(planned) == 1 + (1 + len(smollm2.CONFIGS)) * (len(smollm2.ZERO_SHOT_TASKS) - 1 + 8)


def test_smollm2_only_takes_rows_by_key_or_pattern() -> None:
    """`--only` takes keys as they are, or shell-style patterns of them; the S_l row, which every prune is given,
    always."""
    planned = list(smollm2.planned_rows(["quality", "zero-shot"], [0.2, 0.3]))

    def taken(*only: str) -> list[str]:
        return [key for key in planned if smollm2.chosen(key, list(only))]

    assert taken() == planned
    assert taken("quality/defaults/0.3") == [smollm2.SENSITIVITIES_ROW, "quality/defaults/0.3"]
    boolq = taken("zero-shot/*/0.3/boolq")[1:]
    assert boolq == [f"zero-shot/{config}/0.3/boolq" for config in smollm2.CONFIGS]
    assert taken("zero-shot/dense/0/hellaswag*")[1:] == [
        f"zero-shot/dense/0/{part}" for part in smollm2.measured_tasks("hellaswag")
    ]
    assert len(taken("zero-shot/*/hellaswag (part 1 of 8)")) == 1 + 1 + 2 * len(smollm2.CONFIGS)


def test_smollm2_standard_error_of_an_accuracy_is_lm_evals() -> None:
    """The standard error the zero-shot comparison uses is the one lm-eval reports for a mean of 0/1 scores."""
    from lm_eval.api.metrics import mean_stderr

    scores = [1] * 290 + [0] * 210
    assert smollm2.accuracy_standard_error(0.58, 500) == pytest.approx(mean_stderr(scores), rel=1e-12)


def test_smollm2_a_task_measured_in_parts_is_whole_once_every_part_is_in() -> None:
    """hellaswag's eight parts make one row of the task: its accuracy over all their documents, lm-eval's standard
    error over them, the seconds of all; a model with a part left has none; a model whose every part copied one
    model's accuracy (the same weights) names that model."""
    parts = smollm2.measured_tasks("hellaswag")

    def part(number: int, accuracy: float, documents: int, **copied: str) -> dict:
        figures = {"acc": {"hellaswag": accuracy}, "n_samples": {"hellaswag": documents}}
        return {"zero_shot": figures, "evaluation_seconds": 1200.0 + number} | copied

    rows = {f"zero-shot/dense/0/{name}": part(number, 0.25 + number / 20, 1255 + number % 2) for number, name in
            enumerate(parts)}  # fmt: skip
    rows |= {f"zero-shot/defaults/0.2/{name}": part(0, 0.3, 1255) for name in parts[:7]}
    same = {"same_weights_as": "zero-shot/defaults/0.3/hellaswag (part 1 of 8)"}
    rows |= {f"zero-shot/alpha auto/0.3/{name}": part(0, 0.3, 1255, **same) for name in parts}
    rows["zero-shot/dense/0/piqa"] = part(0, 0.6, 1838)
    whole = smollm2.whole_tasks(rows)
    assert set(whole) == {"zero-shot/dense/0/hellaswag", "zero-shot/alpha auto/0.3/hellaswag", "zero-shot/dense/0/piqa"}
    dense = whole["zero-shot/dense/0/hellaswag"]
    documents = [1255 + number % 2 for number in range(8)]
    accuracy = sum((0.25 + number / 20) * count for number, count in enumerate(documents)) / sum(documents)
    assert dense["zero_shot"]["acc"]["hellaswag"] == pytest.approx(accuracy) and dense["zero_shot"][
        "mean"
    ] == pytest.approx(accuracy)
    assert dense["zero_shot"]["n_samples"]["hellaswag"] == 10044
    assert dense["zero_shot"]["acc_stderr"]["hellaswag"] == pytest.approx(
        smollm2.accuracy_standard_error(accuracy, 10044)
    )
    assert dense["evaluation_seconds"] == 8 * 1200 + 28 and "same_weights_as" not in dense
    assert whole["zero-shot/alpha auto/0.3/hellaswag"]["same_weights_as"] == "zero-shot/defaults/0.3/hellaswag"
    assert whole["zero-shot/dense/0/piqa"] is rows["zero-shot/dense/0/piqa"]


def test_smollm2_zero_shot_progress_counts_the_rows_left_and_their_hours() -> None:
    """Each task's rows left at the median minutes of its rows measured, or its extrapolated minutes where none is,
    and a prune for each pruned model with rows left."""

    def row(seconds: float, **pruned: float | bool) -> dict:
        return {"evaluation_seconds": seconds, "prune_seconds": 0.0} | pruned

    rows = {
        "zero-shot/dense/0/openbookqa": row(60.0),
        "zero-shot/dense/0/winogrande": row(120.0),
        "zero-shot/defaults/0.2/openbookqa": row(30.0, prune_seconds=90.0, pruned_model_reused=False),
        "zero-shot/defaults/0.2/winogrande": row(150.0, pruned_model_reused=True),
        "zero-shot/dense/0/hellaswag (part 1 of 8)": row(1500.0),
    }
    progress = smollm2.zero_shot_progress(rows)
    assert "| openbookqa | 2 | 19 | 0.8 | 0.2 |" in progress  # 1 and 0.5 minutes: 19 x 0.75
    assert "| winogrande | 2 | 19 | 2.2 | 0.7 |" in progress  # 2 and 2.5: 19 x 2.25
    assert "| piqa | 0 | 21 | 6.0 (extrapolated) | 2.1 |" in progress
    assert "| boolq | 0 | 21 | 37.0 (extrapolated) | 12.9 |" in progress
    assert "| hellaswag (8 parts a model, a row each) | 1 | 167 | 25.0 | 69.6 |" in progress  # 21 models' 8 parts
    # 0.24 + 0.71 + 2.1 + 2.45 + 3.5 + 12.95 + 69.58 hours of tasks, and 20 prunes of 1.5 minutes
    assert progress[-1].startswith(
        "5 of 294 rows measured; 289 left, about 92 hours of this machine, with a prune of 1.5 minutes (the median) "
        "for each of the 20 pruned models with rows left."
    )
    assert smollm2.zero_shot_progress({}) == []
    every_row = smollm2.planned_rows(["zero-shot"], list(smollm2.ZERO_SHOT_RATIOS))
    assert smollm2.zero_shot_progress({key: row(60.0) for key in every_row}) == []


# slow (6 s, three prunes): the bench's own runs use it for hours; make test keeps the bench's bookkeeping of rows
@pytest.mark.slow
def test_smollm2_prunes_a_configuration_once_for_its_zero_shot_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench.smollm2.pruned_once, on stories260K as a GGUF in SmolLM2's place: a configuration's first row prunes
    and writes the model to the cache, the next loads that model, another configuration's takes the one place."""
    from casp_core.artifacts.gguf.writer import export_gguf

    source = export_gguf(STORIES, tmp_path / "stories260K.gguf", "f32").path
    monkeypatch.setattr(smollm2, "model_path", lambda settings: str(source))
    monkeypatch.setenv("CASP_CACHE_DIR", str(tmp_path / "cache"))
    settings = {"datasets_dir": default_datasets_dir()}
    quick = {"solver": "diagonal", "allocation": "uniform"}

    def entries() -> list[str]:
        return [path.name for path in (tmp_path / "cache" / smollm2.PRUNED_CACHE).iterdir() if path.name[0] != "."]

    written, _, first = smollm2.pruned_once(settings, 0.3, quick, None)
    loaded, _, again = smollm2.pruned_once(settings, 0.3, quick, None)
    assert (first["pruned_model_reused"], again["pruned_model_reused"]) == (False, True)
    assert again == first | {"pruned_model_reused": True}  # the figures of the prune that made it
    assert 0.25 < first["achieved_ratio"] < 0.35
    in_memory, _, _ = smollm2.pruned(settings, 0.3, quick, None)  # the prune is deterministic: the same model
    tokens = torch.arange(1, 33)[None]
    with torch.no_grad():
        expected = in_memory(tokens).logits
        assert torch.allclose(written(tokens).logits, expected, atol=1e-5)
        assert torch.allclose(loaded(tokens).logits, expected, atol=1e-5)
    [entry] = entries()

    _, _, other = smollm2.pruned_once(settings, 0.3, quick | {"solver": "wanda_sp"}, None)
    assert not other["pruned_model_reused"]
    assert len(entries()) == 1 and entries() != [entry]  # the latest configuration's alone
    _, _, dense = smollm2.pruned_once(settings, 0, {}, None)
    assert dense["achieved_ratio"] == 0 and "pruned_model_reused" not in dense  # loaded from the source, not cached
    assert len(entries()) == 1


def test_smollm2_measures_a_pruned_model_once_on_a_task_whatever_configuration_pruned_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A zero-shot row whose model (its weights and config but casp's provenance: `weights_digest`) a row of the same
    task measured is not evaluated again, and the parent copies that row's accuracy: alpha "auto" choosing the
    default's temperature prunes the defaults' model. Here stories260K stands for both prunes, loaded twice with
    other provenance, and changed in one weight for a third; the evaluation is recorded, not run."""
    from casp_core.model import load_model

    def pruned_once(settings, ratio, overrides, sensitivities) -> tuple:
        model, tokenizer = load_model(str(STORIES))
        model.config.casp = {"settings": overrides}
        if overrides.get("solver") == "wanda_sp":
            with torch.no_grad():
                model.lm_head.weight[0, 0] += 1e-3
        return model, tokenizer, {"pruned_model_reused": False, "prune_seconds": 90.0}

    evaluated: list[dict] = []
    scores_dirs: list[Path] = []

    documents_given: list[range | None] = []

    def zero_shot(model, tokenizer, settings, limit, tasks, scores_dir, documents) -> dict:
        evaluated.append(model.config.casp["settings"])
        scores_dirs.append(scores_dir)
        documents_given.append(documents)
        scores_dir.mkdir(parents=True)  # where evaluate_zero_shot keeps the scores of a row cut short
        return {"acc": {task: 0.25 + len(evaluated) / 100 for task in tasks}}

    monkeypatch.setattr(smollm2, "pruned_once", pruned_once)
    monkeypatch.setattr(smollm2, "zero_shot", zero_shot)
    monkeypatch.setenv("CASP_CACHE_DIR", str(tmp_path))
    settings = {"datasets_dir": default_datasets_dir()}
    key = "zero-shot/defaults/0.2/openbookqa"
    defaults = {"key": key} | smollm2.zero_shot_row(settings, 0.2, {}, "openbookqa", None, {})
    assert defaults["zero_shot"] == {"acc": {"openbookqa": 0.26}} and "same_weights_as" not in defaults
    measured = smollm2.measured_models([defaults], "zero-shot/alpha auto/0.2/openbookqa")
    assert measured == {defaults["weights_digest"]: key}
    assert smollm2.measured_models([defaults], "zero-shot/alpha auto/0.2/piqa") == {}  # another task's accuracy

    auto = smollm2.zero_shot_row(settings, 0.2, {"alpha": "auto"}, "openbookqa", None, measured)
    assert auto["same_weights_as"] == key and "zero_shot" not in auto
    other = smollm2.zero_shot_row(settings, 0.2, {"solver": "wanda_sp"}, "openbookqa", None, measured)
    assert other["weights_digest"] != defaults["weights_digest"] and "same_weights_as" not in other
    assert evaluated == [{}, {"solver": "wanda_sp"}]
    # Each measured model's scores kept under its digest and task while it was scored, and dropped once it was.
    folders = [f"{row['weights_digest'][:24]}-openbookqa" for row in (defaults, other)]
    assert scores_dirs == [tmp_path / smollm2.SCORES_CACHE / folder for folder in folders]
    assert not any(folder.exists() for folder in scores_dirs) and documents_given == [None, None]
    # A part of hellaswag: the task, its second eighth of the 10,042 documents, its own scores.
    part = smollm2.zero_shot_row(settings, 0.2, {"alpha": 1.0}, "hellaswag (part 2 of 8)", None, {})
    assert list(part["zero_shot"]["acc"]) == ["hellaswag"] and documents_given[-1] == range(1255, 2510)
    assert scores_dirs[-1].name == f"{part['weights_digest'][:24]}-hellaswag-part-2-of-8"

    monkeypatch.setattr(smollm2, "run_child", lambda *arguments: auto)
    copied = smollm2.measure_in_child("zero-shot/alpha auto/0.2/openbookqa", settings, None, [defaults])
    assert copied["zero_shot"] == defaults["zero_shot"] and copied["same_weights_as"] == key
    rendered = smollm2.same_weights_lines({key: defaults, copied["key"]: copied})
    assert "alpha auto at 0.2 on openbookqa: defaults at 0.2's" in rendered[-1]
    progress = smollm2.zero_shot_progress({key: defaults | {"evaluation_seconds": 60.0}, copied["key"]: copied})
    assert "| openbookqa | 2 | 19 | 1.0 | 0.3 |" in progress  # both done; the minutes are the one evaluated's


def test_smollm2_measures_a_held_row_again_when_its_prune_would_change(tmp_path: Path) -> None:
    """A row records its prune's settings with casp's defaults resolved; a changed default re-measures the rows it
    changes, and only those."""
    settings = {"models_dir": "models", "datasets_dir": str(tmp_path), "windows": {"128": 4}, "zero_shot_limit": 100}
    defaults = smollm2.prune_record(settings, "quality/defaults/0.2")
    assert defaults["alpha"] == PruneConfig().alpha and defaults["ratio"] == 0.2
    assert defaults["calibration"]["dataset"] == smollm2.CALIBRATION["dataset"]  # no path of this machine
    assert smollm2.prune_record(settings, "ladder/0.3/q4_k_m")["gguf_type"] == "q4_k_m"
    assert smollm2.prune_record(settings, "quality/dense/0") is None
    assert smollm2.prune_record(settings, "ladder/0/dense") is None

    def held(key: str, prune: dict | None) -> bool:
        return smollm2.same_settings({"key": key, "settings": settings, "prune": prune}, settings)

    assert held("quality/defaults/0.2", defaults)
    assert held("quality/dense/0", None)
    assert not held("quality/defaults/0.2", defaults | {"alpha": defaults["alpha"] + 0.5})  # pruned under another
    assert not held("quality/defaults/0.2", None)  # measured before rows recorded their prune
    uniform = smollm2.prune_record(settings, "quality/allocation uniform/0.2")
    assert held("quality/allocation uniform/0.2", uniform)
    assert not held("quality/allocation uniform/0.2", defaults)
    moved = settings | {"datasets_dir": "elsewhere"}  # the same files on another machine
    assert smollm2.same_settings({"key": "quality/defaults/0.2", "settings": moved, "prune": defaults}, settings)
    # Timing the pruned files against a dense one beside them re-measures the rows that write pruned files only.
    timed = settings | {"speed": smollm2.SPEED}
    ladder = smollm2.prune_record(timed, "ladder/0.2/q8_0")
    assert not smollm2.same_settings({"key": "ladder/0.2/q8_0", "settings": settings, "prune": ladder}, timed)
    assert smollm2.same_settings({"key": "ladder/0.2/q8_0", "settings": timed, "prune": ladder}, timed)
    assert smollm2.same_settings({"key": "ladder/0/dense", "settings": settings, "prune": None}, timed)
    assert smollm2.same_settings({"key": "quality/defaults/0.2", "settings": settings, "prune": defaults}, timed)
    assert not smollm2.same_settings(
        {"key": "quality/defaults/0.2", "settings": settings | {"windows": {}}, "prune": defaults}, timed
    )


def test_zero_shot_scorer_compares_the_answers_each_scorer_picks(tmp_path: Path) -> None:
    """bench.zero_shot_scorer counts the documents whose highest-scoring choice differs between the scorers."""
    from lm_eval.api.instance import Instance

    requests = [
        Instance("loglikelihood", {}, ("context", f" choice {idx}"), idx, ("hellaswag", doc_id, 1))
        for doc_id in range(3)
        for idx in range(4)
    ]
    harness = [(-1.0 - idx, False) for doc_id in range(3) for idx in range(4)]  # choice 0 scores highest
    ours = [(-1.0 - idx + 5.0 * (doc_id == 1 and idx == 2), False) for doc_id in range(3) for idx in range(4)]
    assert zero_shot_scorer.picks(requests, harness) == [0, 0, 0]
    assert zero_shot_scorer.picks(requests, ours) == [0, 2, 0]
    machine = {"date": "2026-11-30", "cpu_model": "a CPU", "nproc": 2, "torch": "2.13.0", "torch_threads": 2}
    machine |= {"transformers": "5.24.0", "git_commit": "abc", "loadavg_start": [1.0] * 3, "loadavg_end": [1.0] * 3}
    row = {"task": "hellaswag", "documents": 3, "requests": 12, "work_ratio": 0.55, "plan": "contexts shared"}
    row |= {"harness_seconds": 10.0}
    row |= {"shared_context_seconds": 5.0, "ratio": 0.5, "max_abs_log_likelihood_difference": 2e-5}
    row |= {"greedy_flags_differing": 0, "picks_differing": 1}
    payload = {"machine": machine, "settings": {"model": "m", "limit": 3, "batch_size": 16}, "rows": [row]}
    markdown = zero_shot_scorer.markdown(payload)
    assert "| hellaswag | 3 | 12 | 0.55 | contexts shared | 10.0 | 5.0 | 0.50 | 2.0e-05 | 0 | 1 |" in markdown


def test_kept_scores_copies_two_models_scores_and_restores_them_whole(tmp_path: Path) -> None:
    """bench.kept_scores on a small folder: the archive holds both models' scores, the restore gives back every
    log-likelihood, and the table says so."""
    kept_scores.main(["--requests", "300", "--repeats", "1", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "kept_scores.json").read_text())["row"]
    assert row["requests"] == row["restored_loglikelihoods"] == 300
    assert row["archive_bytes"] > 2 * row["folder_bytes"] > 0
    assert all_finite(row) and min(row[key] for key in row if key.endswith("_seconds")) > 0
    assert "| 300 | " in (tmp_path / "kept_scores.md").read_text()
