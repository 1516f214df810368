"""A sweep to a file-size budget through POST /v1/jobs (issue #23's "Done when", the service's half): `casp serve`
with an in-process worker prunes ptbwiki-7M to 70 % of its dense f16 GGUF; the job's result shows the front and
the pick (the dense q8_0, which beats every pruned file within the budget: issue #40), and frontier.json,
frontier.png and the pick's files are artifacts that download and load."""

import json
import shutil
from itertools import groupby
from pathlib import Path
from typing import Any

import pytest

from casp_core.artifacts.checkpoint import load_pruned
from casp_core.artifacts.gguf.writer import export_gguf, gguf_file_name
from casp_core.job.stages import job_stages
from casp_core.job.sweep.run import FRONTIER_FILE
from casp_core.settings import PruneConfig
from tests.cli.test_embedded import casp_serve
from tests.conftest import PTBWIKI
from tests.service_fixtures import free_port
from worker.runner import FRONTIER_SUMMARY, Segments

# slow (`make test-slow`): a `casp serve` of its own sweeping ptbwiki-7M; `make test` keeps the sweep in the library
# (tests/core/job/sweep/test_sweep.py), its retry in the runner (tests/worker/test_sweep_retry.py) and a budget job
# through the service from the console (tests/console/test_console.py).
pytestmark = [pytest.mark.service, pytest.mark.slow]


def sweep_request(model: Path, budget: int) -> dict[str, Any]:
    return {
        "model": str(model),
        "target": {"max_bytes": budget},
        "ratios": [0.2, 0.4],
        "gguf_types": ["f16", "q8_0"],
        "export": ["gguf"],
        "device": "cpu",
        "allocation": "uniform",
        "calibration": {"dataset": "wikitext2:validation", "n_samples": 8, "seq_len": 128},
        "evaluation": {"perplexity": ["wikitext2"], "seq_len": 128, "limit": 8},
    }


def test_a_sweep_to_a_byte_budget_through_the_service(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    model = Path(shutil.copytree(PTBWIKI, home / "ptbwiki-7M"))  # the home folder is an allowed root in these tests
    budget = int(0.7 * export_gguf(model, tmp_path / "dense-f16.gguf", "f16").bytes)
    request = sweep_request(model, budget)
    out = tmp_path / "out"
    with casp_serve(home, free_port(), workers=1) as client:
        job = client.submit(request)
        events: list[dict[str, Any]] = []
        done = client.wait(job["id"], timeout=300, on_update=events.append)
        assert done["status"] == "succeeded", done
        artifacts = {artifact["name"] for artifact in client.artifacts(job["id"])}
        paths = client.download(job["id"], out)  # checks every sha256
    assert {FRONTIER_FILE, "frontier.png", "report.json", "config.json", "model.safetensors"} <= artifacts
    assert {str(path.relative_to(out)) for path in paths} == artifacts
    assert not [name for name in artifacts if "candidates" in name]
    frontier = json.loads((out / FRONTIER_FILE).read_text())
    pick = frontier["pick"]
    # The result shows the pick and the front, as frontier.json has them.
    shown = done["result"]["frontier"]
    assert shown["target"] == frontier["target"] and shown["target"]["max_bytes"] == budget
    assert shown["pick"] == {key: pick[key] for key in FRONTIER_SUMMARY}
    front = [point for point in frontier["candidates"] if point["on_front"]]
    assert shown["front"] == [{key: point[key] for key in (*FRONTIER_SUMMARY, "dense")} for point in front]
    within = [point for point in frontier["candidates"] if point["within_target"]]
    assert pick == min(within, key=lambda point: point["perplexity"]["wikitext2"]) and pick["bytes"] <= budget
    assert pick["dense"] and pick["variant"] == "q8_0"
    # Why, beside the best pruned point, in the result as in frontier.json.
    assert shown["dense_pick"] == frontier["dense_pick"]
    assert shown["best_pruned"] == {key: frontier["best_pruned"][key] for key in FRONTIER_SUMMARY}
    assert (out / gguf_file_name(pick["variant"])).stat().st_size == pick["bytes"]
    model, _ = load_pruned(out)  # the dense model's checkpoint, as downloaded
    assert sum(parameter.numel() for parameter in model.parameters()) == pick["params"]
    assert done["result"]["achieved_ratio"] == pytest.approx(pick["ratio"], abs=0.05)
    # Progress named each candidate, and went through the sweep's stages in order.
    messages = [event["message"] or "" for event in events]
    units = {message.split(":")[0] for message in messages if message.startswith("candidate ")}
    assert units == {f"candidate {index} of {len(units)}" for index in range(1, len(units) + 1)}, units
    assert len(units) >= 2
    stages = [stage for stage, _ in groupby(e["stage"] for e in events if e["kind"] == "progress")]
    settings = PruneConfig(**{key: value for key, value in request.items() if key != "model"})
    assert stages == list(Segments.of(job_stages(settings)).stages)
