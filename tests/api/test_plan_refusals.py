"""The API, the command line and a job refuse the same bad settings with the same message: each is one call to
casp_core.job.plan.plan_job, from the model's config before any weight loads (stories260K, the demo model)."""

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from casp_core.cli.main import main
from casp_core.errors import InvalidConfig
from casp_core.job.run import run_job
from casp_core.run import Run
from casp_core.settings import PruneConfig
from tests.service_fixtures import DEMO_MODEL, SMALL_JOB

pytestmark = pytest.mark.service

PARKED = {**SMALL_JOB, "device": "cuda"}  # the queue no test worker consumes, should the API take it


@pytest.mark.parametrize(
    ("change", "flags", "param", "reason"),
    [
        # r_max 0.9 of 8 heads is 7 and of 172 channels 154: at most 0.8785 of the decoder's parameters.
        ({"ratio": 0.88}, ["--ratio", "0.88"], "ratio", "at most 0.8785 of the decoder"),
        # w4a16's groups of 32 do not divide stories260K's head_dim of 8.
        ({"quantization": "w4a16"}, ["--ratio", "0.3", "--quantization", "w4a16"], "quantization", "head_dim is 8"),
        # A budget no candidate meets, by the sizes the sweep's plan estimates from the config.
        (
            {"ratio": None, "target": {"max_bytes": 1000}},
            ["--target-bytes", "1000"],
            "target.max_bytes",
            "no candidate fits in 1000 bytes: the smallest reachable is",
        ),
    ],
)
def test_the_api_the_command_line_and_a_job_refuse_alike(
    api: TestClient,
    keys: dict[str, dict[str, str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: dict[str, Any],
    flags: list[str],
    param: str,
    reason: str,
) -> None:
    response = api.post("/v1/jobs", json={**PARKED, **change}, headers=keys["alice"])
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param and reason in error["message"], error

    assert main(["prune", "--model", str(DEMO_MODEL), "--out", str(tmp_path / "cli"), *flags]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"casp: error: invalid_config: {error['message']}"

    stages: list[str] = []
    settings = PruneConfig.from_dict({**{k: v for k, v in SMALL_JOB.items() if k != "model"}, **change})
    with pytest.raises(InvalidConfig) as refused:
        run_job(str(DEMO_MODEL), settings, tmp_path / "job", Run(progress=lambda stage, *_: stages.append(stage)))
    assert refused.value.message == error["message"]
    assert stages == []  # refused from the model's config, before the job reports its first stage
