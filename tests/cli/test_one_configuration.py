"""Every setting of casp_core's config (casp_core.settings.PruneSettings, walked field by field) is settable with the
same name, default and range through POST /v1/jobs, `casp submit` and `casp prune`, and reaches the PruneConfig the
pipeline receives."""

import argparse
from typing import Any, get_origin

import pytest
from fastapi.testclient import TestClient
from pydantic.fields import FieldInfo

from casp_cli.main import register, submit_request
from casp_core.cli import main as cli
from casp_core.cli.setting_flags import flag_of
from casp_core.settings import PruneConfig, PruneSettings, choices_of, setting_fields, without_none
from service.db import session_scope
from service.settings import Settings
from service.tables import Job
from tests.service_fixtures import SMALL_JOB
from worker.runner import job_config

pytestmark = pytest.mark.service

# The cuda queue, which no test worker consumes; recovery data the server has, for when a test turns recovery on.
PARKED = {**SMALL_JOB, "device": "cuda", "recovery": {"dataset": "ptb"}}
# Settings the walk cannot make a value for: free text (a named data set the server has, other than the default),
# keyword-or-number (alpha's word, round_to's number) and size-or-number (max_device_memory, which arrives in bytes;
# its unit forms are tested in tests/core/method/test_placement.py).
TEXT_SAMPLES: dict[str, Any] = {
    "calibration.dataset": "ptb",
    "evaluation.perplexity": ["ptb"],
    "recovery.dataset": "wikitext2:validation",
    "recovery.target_modules": ["q_proj", "v_proj"],
    "alpha": "auto",
    "round_to": 64,
    "max_device_memory": 24 * 2**30,
    "ratios": [0.2, 0.4],
    # Budgets the demo model's candidates meet (an impossible one is refused at submit).
    "target.max_bytes": 10**9,
    "target.max_params": 10**9,
    "recovery.ce_weight": 0.25,  # the middle of [0, 1] is the default
}
# Settings valid only beside another one: a distillation loss trains, so it needs a recovery method.
NEEDS: dict[str, dict[str, Any]] = {"recovery.loss": {"recovery.method": "lora"}}
# A target replaces the ratio; its format and its candidates go with a bytes budget.
TARGET = "target."
FORMAT_NEEDS = {"max_bytes": 10**9}
WITH_A_BUDGET = ("target.format", "target.candidates")
# moe.prune_experts removes experts, which the walk's dense model has none of (refused by name); it reaches the
# pipeline in tests/core/families/test_moe.py (casp prune) and tests/api/test_model_families.py (the API).
SETTINGS = [(name, info) for name, info in setting_fields(PruneSettings) if name != "moe.prune_experts"]


def bounds(info: FieldInfo) -> tuple[float | None, float | None]:
    low = high = None
    for rule in info.metadata:
        low = next((getattr(rule, k) for k in ("gt", "ge") if hasattr(rule, k)), low)
        high = next((getattr(rule, k) for k in ("lt", "le") if hasattr(rule, k)), high)
    return low, high


def sample(name: str, info: FieldInfo) -> Any:
    """A valid value other than the default, so that arriving proves it was set."""
    default = info.get_default(call_default_factory=True)
    if name in TEXT_SAMPLES:
        return TEXT_SAMPLES[name]
    if info.annotation is bool:
        return not default
    choices = choices_of(info.annotation)
    if choices:
        other = next(choice for choice in choices if choice not in (default or []) and choice != default)
        return [other] if get_origin(without_none(info.annotation)) is list else other
    low, high = bounds(info)
    if without_none(info.annotation) is float:
        assert low is not None and high is not None, f"{name}: add a sample value for this setting to TEXT_SAMPLES"
        return (low + high) / 2  # ratio, r_max, compensation_damping: inside their ranges, not the default
    if default is None:
        return int(low) + 5
    assert isinstance(default, int), f"{name}: add a sample value for this kind of setting to TEXT_SAMPLES"
    return default + 1 if high is None or default + 1 <= high else default - 1


def nested(name: str, value: Any) -> dict[str, Any]:
    *parts, leaf = name.split(".")
    body: dict[str, Any] = {leaf: value}
    for part in reversed(parts):
        body = {part: body}
    return body


def merged(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in change.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def value_at(config: PruneConfig, name: str) -> Any:
    value: Any = config
    for part in name.split("."):
        value = getattr(value, part)
    return value


def job_with(name: str, value: Any) -> dict[str, Any]:
    """The parked job with the setting: a target's part in place of the ratio."""
    if not name.startswith(TARGET):
        body = merged(PARKED, nested(name, value))
        for needed, needed_value in NEEDS.get(name, {}).items():
            body = merged(body, nested(needed, needed_value))
        return body
    budget = FORMAT_NEEDS if name in WITH_A_BUDGET else {}
    sweep = {key: setting for key, setting in PARKED.items() if key != "ratio"}
    return {**sweep, "target": {**budget, name.removeprefix(TARGET): value}}


def base_flags(name: str) -> list[str]:
    """--ratio 0.3, or for a target's part what it needs beside it."""
    if not name.startswith(TARGET):
        needed = [argument for need in NEEDS.get(name, {}).items() for argument in (flag_of(need[0]), str(need[1]))]
        return ["--ratio", "0.3", *needed]
    return ["--target-bytes", str(FORMAT_NEEDS["max_bytes"])] if name in WITH_A_BUDGET else []


def flag_args(name: str, info: FieldInfo, value: Any) -> list[str]:
    if info.annotation is bool:
        return [flag_of(name) if value else "--no-" + flag_of(name).removeprefix("--")]
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return [flag_of(name), text]


def parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser([register]).parse_args(argv)


def resolved(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    if "anyOf" in schema and any("$ref" in member for member in schema["anyOf"]):  # an optional part: target
        schema = next(member for member in schema["anyOf"] if "$ref" in member)
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rpartition("/")[2]]
    return schema


def core_property(name: str) -> dict[str, Any]:
    schema = PruneSettings.model_json_schema(ref_template="#/components/schemas/{model}")
    document = {"components": {"schemas": schema.get("$defs", {})}}
    for part in name.split("."):
        schema = resolved(document, schema["properties"][part])
    # FastAPI's OpenAPI leaves a null default out; no default shown means null there.
    return {key: value for key, value in schema.items() if (key, value) != ("default", None)}


def api_property(document: dict[str, Any], name: str) -> dict[str, Any]:
    schema = document["components"]["schemas"]["JobCreate"]
    for part in name.split("."):
        assert part in resolved(document, schema)["properties"], f"{name} is not in the API's request schema"
        schema = resolved(document, resolved(document, schema)["properties"][part])
    return schema


def stored_config(api: TestClient, headers: dict[str, str], body: dict[str, Any], settings: Settings) -> PruneConfig:
    response = api.post("/v1/jobs", json=body, headers=headers)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    api.post(f"/v1/jobs/{job_id}/cancel", headers=headers)
    with session_scope(settings.database) as session:
        return job_config(session.get_one(Job, job_id), settings)


def test_every_setting_has_a_flag_of_its_own() -> None:
    flags = [flag_of(name) for name, _ in SETTINGS]
    assert len(set(flags)) == len(flags), flags


def test_the_api_schema_shows_every_setting_as_the_core_defines_it(api: TestClient) -> None:
    document = api.get("/openapi.json").json()
    for name, _ in SETTINGS:
        # The same name, default, bounds, choices and description.
        assert api_property(document, name) == core_property(name), name


@pytest.mark.parametrize(("name", "info"), SETTINGS, ids=[name for name, _ in SETTINGS])
def test_a_setting_set_anywhere_reaches_the_pipeline(
    name: str, info: FieldInfo, api: TestClient, keys: dict[str, dict[str, str]], distributed_settings: Settings
) -> None:
    value = sample(name, info)
    assert value != info.get_default(call_default_factory=True)
    # POST /v1/jobs, as JSON.
    config = stored_config(api, keys["alice"], job_with(name, value), distributed_settings)
    assert value_at(config, name) == value, "POST /v1/jobs"
    # casp submit, with the setting's flag (the --ratio it needs is overridden when the setting is ratio).
    flag = [*base_flags(name), *flag_args(name, info, value)]
    args = parse(["submit", "--model", PARKED["model"], "--device", "cuda", *flag])
    request = merged(job_with(name, value), submit_request(args))
    config = stored_config(api, keys["alice"], request, distributed_settings)
    assert value_at(config, name) == value, "casp submit"
    # casp prune, with the same flag.
    args = parse(["prune", "--model", PARKED["model"], "--out", "unused", *flag])
    assert value_at(cli.prune_config(args), name) == value, "casp prune"
