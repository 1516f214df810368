"""Budgets as job input through POST /v1/jobs (issue 23): a job gives `ratio` or `target`, and each way of getting
that wrong is a 422 naming the field; a local model's impossible budget is refused at submit with the smallest size
its candidates reach (by the estimate from its config, casp_core.job.sweep.candidates)."""

from typing import Any

import pytest
from fastapi.testclient import TestClient

from casp_core.job.plan import plan_sweep
from casp_core.model import load_config
from casp_core.settings import PruneConfig
from tests.api.test_api import refusal
from tests.service_fixtures import DEMO_MODEL, SMALL_JOB

pytestmark = pytest.mark.service

PARKED = {**SMALL_JOB, "device": "cuda"}
SWEEP = {name: value for name, value in PARKED.items() if name != "ratio"}


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        ({**PARKED, "target": {"max_params": 200_000}}, "ratio", "give ratio or target, not both"),
        (SWEEP, "ratio", "give ratio or target"),
        (
            {**SWEEP, "target": {}},
            "target",
            "give exactly one of max_bytes, max_params, max_perplexity_increase, got none",
        ),
        ({**SWEEP, "target": {"max_bytes": 10**6, "max_params": 10**5}}, "target", "got max_bytes, max_params"),
        ({**SWEEP, "target": {"max_params": 10**5, "format": "gguf"}}, "target.format", "only goes with max_bytes"),
        ({**SWEEP, "target": {"max_bytes": 10**6, "format": "onnx"}}, "target.format", "'gguf' or 'safetensors'"),
        ({**SWEEP, "target": {"max_bytes": "6 parsecs"}}, "target.max_bytes", "24GiB or 500MB, got 6 parsecs"),
        ({**SWEEP, "target": {"max_params": 0}}, "target.max_params", "greater than or equal to 1"),
        ({**SWEEP, "target": {"max_params": "100000"}}, "target.max_params", "valid integer"),  # strict, as the rest
        ({**SWEEP, "target": {"max_perplexity_increase": 0}}, "target.max_perplexity_increase", "greater than 0"),
        ({**SWEEP, "target": {"max_params": 10**5}, "ratios": []}, "ratios", "at least 1 item"),
        ({**SWEEP, "target": {"max_params": 10**5}, "ratios": [0.2, 1.5]}, "ratios.1", "less than 1"),
        ({**SWEEP, "target": {"max_params": 10**5}, "ratios": [0.2, 0]}, "ratios.1", "greater than 0"),
        ({**SWEEP, "target": {"max_params": 10**5}, "ratios": [0.2, 0.2]}, "ratios", "names 0.2 twice"),
        ({**SWEEP, "target": {"max_params": 10**5}, "ratios": [0.5, 0.95]}, "ratios", "at most r_max (0.9), got 0.95"),
        ({**SWEEP, "target": {"max_bytes": 10**6}, "gguf_types": ["q9"]}, "gguf_types.0", "'f32'"),
        ({**SWEEP, "target": {"max_bytes": 10**6}, "keep": "some"}, "keep", "'best' or 'all'"),
    ],
)
def test_a_bad_target_is_422_naming_the_field(
    api: TestClient, keys: dict[str, dict[str, str]], body: dict[str, Any], param: str, reason: str
) -> None:
    error = refusal(api.post("/v1/jobs", json=body, headers=keys["alice"]))
    assert error["code"] == "invalid_request" and error["param"] == param and reason in error["message"], error


def smallest(target: dict[str, Any], measure: str) -> tuple[int, str]:
    """The smallest estimate of the demo model's candidates under a budget everything meets."""
    settings = PruneConfig.from_dict(
        {**{k: v for k, v in SWEEP.items() if k not in ("model", "device")}, "target": target}
    )
    candidates = list(plan_sweep(load_config(str(DEMO_MODEL)), settings).candidates)
    best = min(candidates, key=lambda c: (getattr(c, measure), c.ratio))
    named = best.variant if best.format == "gguf" else f"safetensors {best.variant}"
    return getattr(best, measure), f"ratio {best.ratio}, {named}"


@pytest.mark.parametrize(
    ("target", "measure", "unit"),
    [
        ({"max_bytes": 10**9}, "estimated_bytes", "bytes"),
        ({"max_bytes": 10**9, "format": "safetensors"}, "estimated_bytes", "bytes"),
        ({"max_params": 10**9}, "estimated_params", "parameters"),
    ],
)
def test_an_impossible_budget_is_422_naming_the_smallest_reachable_size(
    api: TestClient, keys: dict[str, dict[str, str]], target: dict[str, Any], measure: str, unit: str
) -> None:
    size, which = smallest(target, measure)
    budget = next(name for name in target if name.startswith("max_"))
    impossible = {**target, budget: size - 1}
    error = refusal(api.post("/v1/jobs", json={**SWEEP, "target": impossible}, headers=keys["alice"]))
    assert error["param"] == f"target.{budget}", error
    assert error["message"] == (
        f"target.{budget}: no candidate fits in {size - 1} {unit}: the smallest reachable is {size} {unit} ({which})"
    ), error
    # The smallest itself is a budget one candidate meets.
    response = api.post("/v1/jobs", json={**SWEEP, "target": {**target, budget: size}}, headers=keys["alice"])
    assert response.status_code == 201, response.text


# A target's settings when only some are given; the pick may be a dense point unless `candidates` says otherwise.
NO_BUDGET = {
    "max_bytes": None,
    "format": None,
    "max_params": None,
    "max_perplexity_increase": None,
    "candidates": "all",
}


@pytest.mark.parametrize(
    ("target", "stored"),
    [
        ({"max_bytes": "500MB"}, {"max_bytes": 500_000_000, "format": "gguf"}),  # gguf unless said otherwise
        ({"max_bytes": 10**6, "format": "safetensors"}, {"max_bytes": 10**6, "format": "safetensors"}),
        ({"max_params": 10**6}, {"max_params": 10**6}),
        ({"max_perplexity_increase": 0.1}, {"max_perplexity_increase": 0.1}),
    ],
)
def test_each_target_form_is_taken_and_kept_in_the_job_s_settings(
    api: TestClient, keys: dict[str, dict[str, str]], target: dict[str, Any], stored: dict[str, Any]
) -> None:
    response = api.post("/v1/jobs", json={**SWEEP, "target": target, "ratios": [0.2, 0.4]}, headers=keys["alice"])
    assert response.status_code == 201, response.text
    settings = response.json()["settings"]
    assert settings["ratio"] is None and settings["ratios"] == [0.2, 0.4], settings
    assert settings["target"] == {**NO_BUDGET, **stored}, settings


def test_the_openapi_schema_shows_an_example_of_each_target_form(
    api: TestClient, keys: dict[str, dict[str, str]]
) -> None:
    document = api.get("/openapi.json").json()
    examples = document["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["examples"]
    budgets = [next(iter(example["value"]["target"])) for example in examples.values() if "target" in example["value"]]
    assert sorted(budgets) == ["max_bytes", "max_params", "max_perplexity_increase"]
    # Each is a request the service takes (a hub model's config is read when the job starts), with data sets this
    # test server has.
    texts = {"calibration": PARKED["calibration"], "evaluation": PARKED["evaluation"], "device": "cuda"}
    for name, example in examples.items():
        response = api.post("/v1/jobs", json={**example["value"], **texts}, headers=keys["alice"])
        assert response.status_code == 201, (name, response.text)
