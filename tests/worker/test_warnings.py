"""A job whose settings forfeit the speedup still runs, and says so: a `warning` event as soon as the model is
loaded, and `result.warnings` at the end (the report carries it too). Run by hand in the embedded mode, as a
worker runs it: ptbwiki-7M's 704 FFN channels, where auto would round to 8 and the job asks for 1."""

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from casp_core.rounding import speed_warning
from service.storage import make_storage
from tests.conftest import PTBWIKI
from tests.core.families.test_moe import write_unreached_mixtral
from tests.service_fixtures import REPO, TINY_JOB, embedded_settings
from worker.runner import execute

pytestmark = pytest.mark.service

FAST = {"solver": "diagonal", "allocation": "uniform", "device": "cpu"}  # the warning is about the counts only


def test_a_round_to_that_forfeits_the_speedup_is_a_job_event_and_in_the_result(tmp_path: Path) -> None:
    settings = embedded_settings(tmp_path, allowed_model_roots=[REPO / "demo", PTBWIKI.parent])
    expected = speed_warning([704], 1)
    with TestClient(create_app(settings)) as client:
        body = {**TINY_JOB, **FAST, "model": str(PTBWIKI), "round_to": 1}
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        assert execute(job_id, settings, make_storage(settings), worker_id="by-hand") == "succeeded"
        job = client.get(f"/v1/jobs/{job_id}").json()
        events = client.get(f"/v1/jobs/{job_id}/events").json()["data"]
    assert job["result"]["warnings"] == [expected]
    warnings = [event for event in events if event["kind"] == "warning"]
    assert [(event["message"], event["status"]) for event in warnings] == [(expected, "running")]
    assert warnings[0]["stage"] == "load"  # as soon as the model's widths are known, not at the end


@pytest.mark.slow  # 11 s: the warning is tests/core/families/test_moe.py's, its path to an event the test above's
def test_an_expert_no_calibration_token_reaches_is_a_job_event_and_in_the_result(tmp_path: Path) -> None:
    """Issue 26: the mixture of experts' unreached expert is reported where a job's user looks, as it happens."""
    model = write_unreached_mixtral(tmp_path / "models" / "mixtral")
    settings = embedded_settings(tmp_path, allowed_model_roots=[REPO / "demo", model.parent])
    with TestClient(create_app(settings)) as client:
        job_id = client.post("/v1/jobs", json={**TINY_JOB, **FAST, "model": str(model)}).json()["id"]
        assert execute(job_id, settings, make_storage(settings), worker_id="by-hand") == "succeeded"
        job = client.get(f"/v1/jobs/{job_id}").json()
        events = client.get(f"/v1/jobs/{job_id}/events").json()["data"]
    expected = [f"layer {index}: no calibration token reached experts [3]: kept whole" for index in (0, 1)]
    assert job["result"]["warnings"] == expected
    warnings = [event for event in events if event["kind"] == "warning"]
    assert [(event["message"], event["stage"]) for event in warnings] == [(text, "pruning") for text in expected]
