"""The sweep job (casp_core.job.sweep.run): the front and the pick on points of known sizes, and whole sweeps on the
demo model: every candidate's files with keep "all", a perplexity target no candidate meets, and a retry that resumes
after the candidates already measured."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from casp_core.artifacts.checkpoint import load_pruned
from casp_core.artifacts.gguf.writer import gguf_file_name
from casp_core.artifacts.snapshot import SNAPSHOT_FILE
from casp_core.errors import BudgetUnmet, Cancelled, InvalidConfig
from casp_core.job.run import run_job
from casp_core.job.sweep.run import CANDIDATES_DIR, FRONTIER_FILE, SWEEP_STATE_FILE, Point, Target, on_front
from casp_core.run import Run
from casp_core.settings import PruneConfig
from tests.conftest import DATASETS_DIR, STORIES


def point(ratio: float, variant: str, size: int, perplexity: float, *, params: int = 1000) -> Point:
    return Point(ratio, "gguf", variant, size, params, {"wikitext2": perplexity}, 1.0, ratio == 0.0, False)


def target(dense_perplexity: float = 10.0, **budget: float | str) -> Target:
    return Target(PruneConfig(target=budget), dense_perplexity)


def measured(goal: Target, points: list[Point]) -> list[Point]:
    return [
        replace(p, within_target=goal.met_by(p.bytes, p.params, p.perplexity["wikitext2"])) for p in on_front(points)
    ]


POINTS = [
    point(0.0, "f16", 1000, 10.0),
    point(0.0, "q8_0", 530, 10.1),
    point(0.2, "f16", 800, 11.0),  # beaten by the dense q8_0: smaller and lower
    point(0.2, "q8_0", 420, 11.2),
    point(0.4, "q8_0", 330, 13.0),
    point(0.4, "f16", 600, 12.0),  # beaten by 0.2 q8_0
]


def test_the_front_is_the_points_no_other_beats_in_size_and_perplexity() -> None:
    front = {(p.ratio, p.variant) for p in on_front(POINTS) if p.on_front}
    assert front == {(0.0, "f16"), (0.0, "q8_0"), (0.2, "q8_0"), (0.4, "q8_0")}
    # A tie in one figure and a win in the other still beats; an exact twin beats neither.
    tied = on_front([point(0.1, "f16", 500, 12.0), point(0.2, "f16", 500, 11.0), point(0.3, "f16", 400, 11.0)])
    assert [p.on_front for p in tied] == [False, False, True]
    twins = on_front([point(0.1, "f16", 500, 12.0), point(0.2, "f16", 500, 12.0)])
    assert [p.on_front for p in twins] == [True, True]


def test_the_pick_of_a_size_budget_is_the_lowest_perplexity_within_it() -> None:
    goal = target(max_bytes=700, candidates="pruned")
    points = measured(goal, POINTS)
    assert [p.within_target for p in points] == [False, True, False, True, True, True]
    pick = goal.pick(points)
    assert (pick.ratio, pick.variant) == (0.2, "q8_0")  # 0.4 f16 is within too, but higher
    # The dense q8_0 is within and lower: worth a warning that names it, and the setting that would pick it.
    warning = goal.better_dense(points, pick)
    assert warning.startswith("the dense model (dense, q8_0: 530 bytes, perplexity 10.1)")
    assert "target.candidates all would hand it back" in warning
    # Within 400 bytes only 0.4 q8_0 fits; within 300 none does, and the error names the smallest produced.
    goal = target(max_bytes=400)
    assert goal.pick(measured(goal, POINTS)).ratio == 0.4
    goal = target(max_bytes=300)
    assert goal.pick(measured(goal, POINTS)) is None
    with pytest.raises(
        BudgetUnmet, match=r"target.max_bytes: .* 300 bytes .* smallest produced is 330 bytes \(ratio 0.4, q8_0\)"
    ):
        raise goal.unmet(measured(goal, POINTS))


def test_the_pick_of_a_perplexity_increase_is_the_smallest_file_within_it() -> None:
    goal = target(10.0, max_perplexity_increase=0.15)  # perplexity up to 11.5: the dense points are larger
    points = measured(goal, POINTS)
    pick = goal.pick(points)
    assert (pick.ratio, pick.variant) == (0.2, "q8_0")  # the smallest of 0.2 f16 and 0.2 q8_0
    assert goal.better_dense(points, pick) is None  # the dense points are larger
    goal = target(10.0, max_perplexity_increase=0.05, candidates="pruned")
    assert goal.pick(measured(goal, POINTS)) is None
    with pytest.raises(BudgetUnmet, match=r"lowest measured is 11 \(ratio 0.2, f16\)"):
        raise goal.unmet(measured(goal, POINTS))


def test_by_default_the_pick_may_be_the_dense_model_and_says_why() -> None:
    """target.candidates "all" (the default): a dense point that beats every pruned one within the target is the
    pick, and the reason names the best pruned point beside it."""
    goal = target(max_bytes=700)
    points = measured(goal, POINTS)
    pick = goal.pick(points)
    assert (pick.ratio, pick.variant, pick.dense) == (0.0, "q8_0", True)  # 10.1 beats 0.2 q8_0's 11.2
    assert goal.better_dense(points, pick) is None  # nothing better to warn of
    assert goal.dense_pick_reason(pick, goal.best(points, dense=False)) == (
        "the dense model in q8_0 beats every pruned candidate within 700 bytes of gguf: perplexity 10.1 at 530 "
        "bytes; the best pruned candidate within it is ratio 0.2, q8_0: perplexity 11.2 at 420 bytes"
    )
    # A perplexity increase only the dense points meet: the smallest of them, and no pruned point beside it.
    goal = target(10.0, max_perplexity_increase=0.05)
    points = measured(goal, POINTS)
    pick = goal.pick(points)
    assert (pick.dense, pick.variant) == (True, "q8_0") and goal.best(points, dense=False) is None
    assert goal.dense_pick_reason(pick, None) == (
        "the dense model in q8_0 is the smallest file within perplexity 10.5 (0.05 above the dense model's 10): "
        "perplexity 10.1 at 530 bytes; no pruned candidate is within it"
    )
    # Where a pruned point is better, it is the pick whatever the setting.
    goal = target(max_bytes=450)
    assert not goal.pick(measured(goal, POINTS)).dense


def test_the_pick_of_a_parameter_budget_counts_parameters() -> None:
    goal = target(max_params=900)
    points = measured(goal, [point(0.2, "f16", 800, 11.0, params=950), point(0.4, "f16", 600, 12.0, params=800)])
    assert goal.pick(points).ratio == 0.4


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"recovery": {"method": "lora"}}, "recovery: a sweep (target) does not recover its candidates"),
        ({"evaluation": {"perplexity": []}}, "evaluation.perplexity: a sweep (target) picks by perplexity"),
    ],
)
def test_what_a_sweep_cannot_do_is_refused_before_any_work(settings: dict, refusal: str) -> None:
    with pytest.raises(InvalidConfig, match=f"^{re.escape(refusal)}"):
        PruneConfig(target={"max_bytes": "1GB"}, **settings).validate()
    PruneConfig(ratio=0.3, **settings).validate()  # a single-ratio job can


def sweep_config(**settings: object) -> PruneConfig:
    """A sweep of the demo model in seconds: 2 ratios, 4 calibration windows and 4 evaluation windows of 64 tokens."""
    small = {
        "ratios": [0.2, 0.4],
        "gguf_types": ["f16"],
        "export": ["gguf"],
        "solver": "diagonal",
        "calibration": {"dataset": "wikitext2:validation", "n_samples": 4, "seq_len": 64, "batch_size": 4},
        "evaluation": {"perplexity": ["wikitext2"], "seq_len": 64, "limit": 4},
        "datasets_dir": str(DATASETS_DIR),
    }
    return PruneConfig(**{**small, **settings})


def test_keep_all_keeps_every_candidate_and_the_pick_of_a_perplexity_target_is_the_smallest(tmp_path: Path) -> None:
    out = tmp_path / "out"
    calibration = {"dataset": "wikitext2:validation", "n_samples": 4, "seq_len": 64, "mode": "dense"}
    config = sweep_config(
        target={"max_perplexity_increase": 10.0},
        ratios=[0.2, 0.4],
        gguf_types=["f16", "q8_0"],
        keep="all",
        calibration=calibration,  # the layer pass shared by the ratios (prune_ratios' dense mode)
    )
    report = run_job(str(STORIES), config, out)
    frontier = json.loads((out / FRONTIER_FILE).read_text())
    candidates, pick = frontier["candidates"], frontier["pick"]
    assert len(candidates) == 2 + 2 * 2 and all(point["within_target"] for point in candidates)
    assert pick == min((point for point in candidates if not point["dense"]), key=lambda point: point["bytes"])
    # Every point's file is in the output where frontier.json says, each GGUF the size measured.
    for point in candidates:
        path = out / point["path"]
        assert path.is_file() and path.stat().st_size == point["bytes"], point
    assert {path.name for path in (out / CANDIDATES_DIR).iterdir()} == {
        "dense", "ratio-0.20", "ratio-0.40", "ratio-0.20-block32", "ratio-0.40-block32",
    }  # fmt: skip
    # Each candidate folder is a checkpoint of its ratio, loadable as it is.
    model, _ = load_pruned(out / CANDIDATES_DIR / "ratio-0.40-block32")
    settings = json.loads((out / CANDIDATES_DIR / "ratio-0.40-block32" / "config.json").read_text())["casp"]["settings"]
    assert settings["ratio"] == 0.4 and settings["gguf_type"] == "q8_0"
    assert sum(p.numel() for p in model.parameters()) == next(
        point["params"] for point in candidates if (point["ratio"], point["variant"]) == (0.4, "q8_0")
    )
    # The pick at the top of the output too, its report and card those of its single-ratio job.
    assert pick["path"] == gguf_file_name(pick["variant"]) and (out / pick["path"]).stat().st_size == pick["bytes"]
    assert report["settings"]["ratio"] == pick["ratio"] and report["settings"]["gguf_type"] == pick["variant"]


def test_a_safetensors_budget_hands_back_the_quantized_checkpoint_it_measured(tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = sweep_config(
        # Among the pruned candidates: the dense checkpoint, lower in perplexity, would be the pick by default.
        target={"max_bytes": "100MB", "format": "safetensors", "candidates": "pruned"},
        ratios=[0.3],
        quantizations=["none", "w8a8_int8"],
    )
    report = run_job(str(STORIES), config, out)
    frontier = report["frontier"]
    assert [(p["ratio"], p["variant"]) for p in frontier["candidates"]] == [
        (0.0, "none"), (0.0, "w8a8_int8"), (0.3, "none"), (0.3, "w8a8_int8"),
    ]  # fmt: skip
    # Each point's bytes are its weights as written, each in transformers (the quantized ones loaded back).
    dense = frontier["candidates"][0]
    assert dense["bytes"] == (STORIES / "model.safetensors").stat().st_size
    assert dense["perplexity"] == frontier["dense_perplexity"]
    pick = frontier["pick"]
    assert pick == min(frontier["candidates"][2:], key=lambda point: point["perplexity"]["wikitext2"])
    # The output is the pick's checkpoint: quantized with its scheme (or not), of its bytes and perplexity.
    config_json = json.loads((out / "config.json").read_text())
    assert ("quantization_config" in config_json) == (pick["variant"] != "none")
    assert report["settings"]["quantization"] == pick["variant"] and pick["path"] == "model.safetensors"
    assert (out / "model.safetensors").stat().st_size == pick["bytes"]
    checkpoint_row, gguf_row = report["artifacts"]["rows"]
    assert checkpoint_row["perplexity"] == pick["perplexity"] and checkpoint_row["bytes"] == pick["bytes"]
    # The GGUF the job asked for beside it (`export`), measured in llama.cpp as a single-ratio job's.
    assert gguf_row["file"] == "model-f16.gguf" and gguf_row["perplexity_in"] == "llama.cpp"
    assert gguf_row["perplexity"]["wikitext2"] != pick["perplexity"]["wikitext2"]
    assert not (out / CANDIDATES_DIR).exists()


def test_a_target_no_candidate_meets_fails_naming_the_closest(tmp_path: Path) -> None:
    # Among the pruned candidates: the dense f16 file may measure as low as the dense model in transformers.
    config = sweep_config(target={"max_perplexity_increase": 1e-6, "candidates": "pruned"}, ratios=[0.3])
    with pytest.raises(BudgetUnmet, match=r"^target.max_perplexity_increase: no candidate's perplexity is within"):
        run_job(str(STORIES), config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# slow (16 s): tests/worker/test_sweep_retry.py resumes a sweep through the runner and its stored state in make test
@pytest.mark.slow
def test_a_retry_resumes_after_the_candidates_already_measured(tmp_path: Path) -> None:
    state = tmp_path / "state"
    # Among the pruned candidates only: the dense f16 would beat both, and the retry is of the best one's model.
    config = sweep_config(target={"max_bytes": "100MB", "candidates": "pruned"})
    reports: list[tuple[str, str]] = []
    saved: list[str] = []

    def second_started() -> bool:
        return any(message.startswith("candidate 2 of 2") for _, message in reports)

    first = Run(progress=lambda stage, _, message="": reports.append((stage, message)), should_cancel=second_started)
    with pytest.raises(Cancelled):
        run_job(str(STORIES), config, tmp_path / "first", first, retry_state=state, on_retry_state_saved=saved.append)
    assert not (tmp_path / "first").exists()
    kept = json.loads((state / SWEEP_STATE_FILE).read_text())
    assert kept["finished"] == ["ratio-0.20"] and kept["best"] == "ratio-0.20"
    # Every save was handed to the caller (the worker stores them): the dense points, then the candidate.
    assert [Path(path).name for path in saved] == [SWEEP_STATE_FILE, SNAPSHOT_FILE, SWEEP_STATE_FILE]

    reports.clear()
    report = run_job(str(STORIES), config, tmp_path / "second", Run(progress=lambda s, _, m="": reports.append((s, m))),
                     retry_state=state)  # fmt: skip
    messages = [message for _, message in reports]
    # The dense model was neither evaluated nor exported again, and the first candidate not pruned again.
    assert "evaluation" not in {stage for stage, _ in reports} and "dense_points" not in {stage for stage, _ in reports}
    assert not [message for message in messages if message.startswith("candidate 1 of 2")]
    assert any(message.startswith("candidate 2 of 2: ratio 0.4 (f16)") for message in messages)
    assert "resumed after the dense model's evaluation, 1 candidate already measured" in messages
    # Its points are those the first attempt measured (the seconds too); the second candidate's are new.
    resumed = {(p["ratio"], p["variant"]): p for p in kept["points"]}
    for point in report["frontier"]["candidates"]:
        if (point["ratio"], point["variant"]) in resumed:
            assert {**point, "on_front": None, "path": None} == {**resumed.pop((point["ratio"], point["variant"])),
                                                                  "on_front": None, "path": None}  # fmt: skip
    assert not resumed
    # The pick is the first candidate, whose checkpoint came from the snapshot: the output is its.
    pick = report["frontier"]["pick"]
    assert pick["ratio"] == 0.2
    assert json.loads((tmp_path / "second" / "config.json").read_text())["casp"]["settings"]["ratio"] == 0.2
    assert (tmp_path / "second" / pick["path"]).stat().st_size == pick["bytes"]
