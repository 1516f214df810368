"""Hostile and malformed input against PostgreSQL: every refusal is a 4xx in the one error shape, never a 500,
and the path rules hold at submit and again in the worker."""

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from huggingface_hub import constants

from api.main import create_app
from casp_cli.client import CaspAPIError, CaspClient
from service.db import session_scope
from service.settings import Settings
from service.storage import make_storage
from service.tables import Job
from tests.api.test_api import PARKED, refusal
from tests.service_fixtures import DEMO_MODEL, FIXTURE_DATA
from worker.runner import execute

pytestmark = pytest.mark.service


def raw_body(number: str, *where: str) -> str:
    """PARKED as JSON with a literal number (NaN, Infinity, 1e309: json.dumps would not write them) at `where`."""
    body: dict[str, Any] = json.loads(json.dumps(PARKED))
    parent = body
    for key in where[:-1]:
        parent = parent.setdefault(key, {})
    parent[where[-1]] = "@NUMBER@"
    return json.dumps(body).replace('"@NUMBER@"', number)


@pytest.mark.parametrize(
    ("number", "where"),
    [
        ("Infinity", ("alpha",)),
        ("1e309", ("alpha",)),
        ("101", ("alpha",)),
        ("NaN", ("ratio",)),
        ("-Infinity", ("ratio",)),
        (str(2**70), ("calibration", "seed")),
        ("-1", ("calibration", "seed")),
        ("1e300", ("calibration", "n_samples")),
        ("10000000", ("evaluation", "limit")),
    ],
)
def test_numbers_must_be_finite_and_in_range(
    api: TestClient, keys: dict[str, dict[str, str]], number: str, where: tuple[str, ...]
) -> None:
    headers = {**keys["alice"], "Content-Type": "application/json"}
    error = refusal(api.post("/v1/jobs", content=raw_body(number, *where), headers=headers))
    assert error["code"] == "invalid_request" and error["param"] == ".".join(where), error


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"model": f"{DEMO_MODEL}\x00"}, "model"),
        ({"model": "org/name", "revision": "main\x07"}, "revision"),
        ({"calibration": {**PARKED["calibration"], "dataset": "wikitext2\x00"}}, "calibration.dataset"),
        ({"evaluation": {"perplexity": ["/tmp/a\nb.txt"]}}, "evaluation.perplexity.0"),
        ({"metadata": {"team": "llm\x00"}}, "metadata.team"),
    ],
)
def test_control_characters_are_refused(
    api: TestClient, keys: dict[str, dict[str, str]], change: dict[str, Any], param: str
) -> None:
    error = refusal(api.post("/v1/jobs", json={**PARKED, **change}, headers=keys["alice"]))
    assert error["param"] == param and "control characters" in error["message"], error


@pytest.mark.parametrize(
    ("change", "param", "missing"),
    [
        # The fixtures hold WikiText-2's validation and test splits, not its training split (the default).
        ({"calibration": {**PARKED["calibration"], "dataset": "wikitext2"}}, "calibration.dataset", "wikitext2 train"),
        ({"evaluation": {"perplexity": ["ptb", "c4:validation"]}}, "evaluation.perplexity.1", "c4 validation"),
    ],
)
def test_a_named_data_set_that_is_not_installed_is_refused_at_submit(
    api: TestClient, keys: dict[str, dict[str, str]], change: dict[str, Any], param: str, missing: str
) -> None:
    error = refusal(api.post("/v1/jobs", json={**PARKED, **change}, headers=keys["alice"]))
    assert error["param"] == param and missing in error["message"] and "none exists" in error["message"], error


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"model": f"{DEMO_MODEL.parent}/{'b' * 300}"}, "model"),
        (
            {"calibration": {**PARKED["calibration"], "dataset": f"{FIXTURE_DATA}/{'b' * 300}.txt"}},
            "calibration.dataset",
        ),
        # Bytes count, not characters: 200 two-byte characters are 400 bytes.
        ({"evaluation": {"perplexity": [f"{FIXTURE_DATA}/{'é' * 200}.txt"]}}, "evaluation.perplexity.0"),
    ],
)
def test_a_path_component_longer_than_the_system_takes_is_422(
    api: TestClient, keys: dict[str, dict[str, str]], change: dict[str, Any], param: str
) -> None:
    error = refusal(api.post("/v1/jobs", json={**PARKED, **change}, headers=keys["alice"]))
    assert error["param"] == param and "longer than the system's limit of 255 bytes" in error["message"], error


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"ratio": "0.2"}, "ratio"),
        ({"calibration": {**PARKED["calibration"], "seed": "0"}}, "calibration.seed"),
        ({"evaluation": {**PARKED["evaluation"], "limit": 8.0}}, "evaluation.limit"),
        ({"recovery": {"gradient_checkpointing": "true"}}, "recovery.gradient_checkpointing"),
    ],
)
def test_settings_are_strictly_typed(
    api: TestClient, keys: dict[str, dict[str, str]], change: dict[str, Any], param: str
) -> None:
    error = refusal(api.post("/v1/jobs", json={**PARKED, **change}, headers=keys["alice"]))
    assert error["param"] == param and error["message"].startswith(f"{param}: Input should be a valid"), error


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"ratio": 0.2,\n "model" "x"}', "Expecting ':' delimiter at line 2 column 10 (char 24)"),
        (b"[" * 10_000, "nested 10000 levels deep, too deep to read, the deepest at line 1 column 10000 (char 9999)"),
        (
            b'{"ratio": 0.2, "calibration": {"seed": ' + b"7" * 5000 + b"}}",
            "an integer longer than 4300 digits at line 1 column 40 (char 39)",
        ),
        (b'{"model": "\xff"}', "not UTF-8 at byte 11"),
    ],
)
def test_a_body_that_is_not_readable_json_says_where(
    api: TestClient, keys: dict[str, dict[str, str]], body: bytes, reason: str
) -> None:
    headers = {**keys["alice"], "Content-Type": "application/json"}
    error = refusal(api.post("/v1/jobs", content=body, headers=headers))
    assert error["code"] == "invalid_request" and error["param"] is None
    assert error["message"] == f"the body is not JSON the service can read: {reason}", error


def test_options_and_405_list_every_method_of_the_path(api: TestClient, keys: dict[str, dict[str, str]]) -> None:
    job_path = f"/v1/jobs/{'0' * 32}"
    for path, methods in ((job_path, "GET, DELETE, OPTIONS"), ("/v1/jobs", "GET, POST, OPTIONS")):
        options = api.options(path)
        assert options.status_code == 204 and options.headers["Allow"] == methods
    refused = api.put(job_path, headers=keys["alice"])
    assert refusal(refused, 405)["code"] == "method_not_allowed" and refused.headers["Allow"] == "GET, DELETE, OPTIONS"
    assert api.options("/no/such/route").status_code == 404


def test_a_body_over_the_limit_is_413(
    api: TestClient, keys: dict[str, dict[str, str]], distributed_settings: Settings
) -> None:
    limit = distributed_settings.max_request_bytes
    padded = {**PARKED, "metadata": {"pad": "x" * 500}}
    oversized = json.dumps(padded).replace('"x', '"' + "x" * limit, 1).encode()
    headers = {**keys["alice"], "Content-Type": "application/json"}
    error = refusal(api.post("/v1/jobs", content=oversized, headers=headers), 413)
    assert error["code"] == "request_too_large" and str(limit) in error["message"]
    # Without a Content-Length (chunked), the body is counted as it arrives.
    chunks = iter([oversized[i : i + 4096] for i in range(0, len(oversized), 4096)])
    error = refusal(api.post("/v1/jobs", content=chunks, headers=headers), 413)
    assert error["code"] == "request_too_large"


def test_a_422_echoes_at_most_an_excerpt_of_the_input(api: TestClient, keys: dict[str, dict[str, str]]) -> None:
    long_name = "k" * 5000
    response = api.post("/v1/jobs", json={**PARKED, long_name: 1}, headers=keys["alice"])
    error = refusal(response)
    assert error["param"].startswith("kkk") and len(error["param"]) < 100
    assert len(response.content) < 500
    # A reason that quotes the input (an unknown split) is cut too.
    long_split = {"calibration": {**PARKED["calibration"], "dataset": "ptb:" + "s" * 1000}}
    response = api.post("/v1/jobs", json={**PARKED, **long_split}, headers=keys["alice"])
    assert "no split" in refusal(response)["message"] and len(response.content) < 500


def test_identifiers_that_cannot_be_ids_are_refused_before_the_database(
    api: TestClient, keys: dict[str, dict[str, str]]
) -> None:
    # PostgreSQL cannot hold a NUL in text nor an event id beyond a BIGINT: both were 500s.
    assert refusal(api.get("/v1/jobs/abc%00", headers=keys["alice"]))["param"] == "job_id"
    assert refusal(api.get("/v1/jobs", params={"after": "a\x00"}, headers=keys["alice"]))["param"] == "after"
    events = api.get(f"/v1/jobs/{'0' * 32}/events", params={"after": 10**20}, headers=keys["alice"])
    assert refusal(events)["param"] == "after"
    # A non-ASCII signature used to break the HMAC comparison.
    download = api.get(f"/v1/files/{'0' * 32}/config.json", params={"expires": 2**40, "signature": "é" * 64})
    assert refusal(download, 403)["code"] == "forbidden"


def test_every_error_has_the_one_shape(api: TestClient, keys: dict[str, dict[str, str]]) -> None:
    unauthorized = api.get("/v1/jobs")
    assert refusal(unauthorized, 401)["code"] == "unauthorized"
    assert unauthorized.headers["WWW-Authenticate"] == "Bearer"
    assert refusal(api.get(f"/v1/jobs/{'f' * 32}", headers=keys["alice"]), 404) == {
        "code": "not_found",
        "message": f"no job {'f' * 32}",
        "param": None,
    }
    assert refusal(api.get("/no/such/route"), 404)["code"] == "not_found"
    assert refusal(api.put("/v1/jobs", headers=keys["alice"]), 405)["code"] == "method_not_allowed"
    assert refusal(api.get("/v1/jobs", params={"limit": 0}, headers=keys["alice"]))["param"] == "limit"
    bad_json = api.post("/v1/jobs", content=b"{", headers={**keys["alice"], "Content-Type": "application/json"})
    assert refusal(bad_json)["code"] == "invalid_request"


def test_the_openapi_document_lists_the_errors_and_the_bearer_scheme(api: TestClient) -> None:
    document = api.get("/openapi.json").json()
    error_ref = "#/components/schemas/ErrorBody"
    assert set(document["components"]["schemas"]["ErrorDetail"]["properties"]) == {"code", "message", "param"}
    for path, operations in document["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, operation in operations.items():
            errors = {code: r for code, r in operation["responses"].items() if code[0] in "45"}
            assert "422" in errors, (method, path)
            for code, response in errors.items():
                assert response["content"]["application/json"]["schema"]["$ref"] == error_ref, (method, path, code)
    submit = document["paths"]["/v1/jobs"]["post"]
    assert {"401", "409", "413", "422", "503"} <= set(submit["responses"])
    assert document["components"]["securitySchemes"] == {
        "HTTPBearer": {"type": "http", "scheme": "bearer", "description": "an API key from `casp keys create`"}
    }
    assert submit["security"] == [{"HTTPBearer": []}]


def test_the_python_client_reads_the_error_shape(api: TestClient, keys: dict[str, dict[str, str]]) -> None:
    with CaspClient("http://testserver") as casp:
        casp.http = TestClient(api.app, headers=keys["alice"])
        with pytest.raises(CaspAPIError) as refused:
            casp.submit({**PARKED, "ratio": 2})
    assert refused.value.status_code == 422 and refused.value.code == "invalid_request"
    assert refused.value.param == "ratio" and "less than 1" in refused.value.message


# --- the path rules, with allowed roots of the test's own ---


@pytest.fixture
def rooted(distributed_settings: Settings, tmp_path: Path) -> Iterator[tuple[TestClient, Settings, Path]]:
    """An API whose only allowed root is a fresh folder holding a model and a text file, symbolic links that
    stay inside, and symbolic links that lead out of it (to the demo model, to a text file elsewhere)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    shutil.copytree(DEMO_MODEL, root / "model")
    (root / "inner-link").symlink_to(root / "model")
    (root / "escape").symlink_to(DEMO_MODEL)
    shutil.copy(FIXTURE_DATA / "ptb" / "ptb.valid.txt", root / "text.txt")
    shutil.copy(FIXTURE_DATA / "ptb" / "ptb.valid.txt", outside / "text.txt")
    (root / "escape.txt").symlink_to(outside / "text.txt")
    settings = distributed_settings.model_copy(update={"allowed_model_roots": [root], "datasets_dir": None})
    yield TestClient(create_app(settings)), settings, root


def with_calibration(body: dict[str, Any], dataset: str) -> dict[str, Any]:
    return {**body, "calibration": {**body["calibration"], "dataset": dataset}}


def test_dotdot_and_symlink_escapes_are_refused_at_submit(
    rooted: tuple[TestClient, Settings, Path], keys: dict[str, dict[str, str]]
) -> None:
    client, _, root = rooted
    # No datasets dir here: evaluation reads a file too.
    parked = {**PARKED, "evaluation": {**PARKED["evaluation"], "perplexity": [str(root / "text.txt")]}}
    for model in (root / "model", root / "inner-link"):
        accepted = client.post("/v1/jobs", json={**parked, "model": str(model)}, headers=keys["alice"])
        assert accepted.status_code == 201, accepted.text
        assert accepted.json()["model"] == str(root / "model")
        client.post(f"/v1/jobs/{accepted.json()['id']}/cancel", headers=keys["alice"])
    for model in (root / "escape", f"{root}/model/../../outside"):
        error = refusal(client.post("/v1/jobs", json={**parked, "model": str(model)}, headers=keys["alice"]))
        assert error["param"] == "model" and "CASP_ALLOWED_MODEL_ROOTS" in error["message"], error
    for dataset in (root / "escape.txt", f"{root}/../outside/text.txt"):
        body = with_calibration({**parked, "model": str(root / "model")}, str(dataset))
        error = refusal(client.post("/v1/jobs", json=body, headers=keys["alice"]))
        assert error["param"] == "calibration.dataset" and "CASP_ALLOWED_MODEL_ROOTS" in error["message"], error


def run_forged(
    client: TestClient, settings: Settings, headers: dict[str, str], body: dict[str, Any], **forged: Any
) -> dict[str, Any]:
    """Submit `body` (parked on the cuda queue), rewrite its row past the API with `forged`, run it here on the
    CPU as a worker would; the job as the API then shows it."""
    response = client.post("/v1/jobs", json=body, headers=headers)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    with session_scope(settings.database) as session:
        row = session.get_one(Job, job_id)
        row.device = "cpu"
        for name, value in forged.items():
            setattr(row, name, value)
    execute(job_id, settings, make_storage(settings), worker_id="test-worker")
    return client.get(f"/v1/jobs/{job_id}", headers=headers).json()


def test_the_worker_refuses_rows_forged_past_the_api(
    rooted: tuple[TestClient, Settings, Path], keys: dict[str, dict[str, str]]
) -> None:
    client, settings, root = rooted
    body = {
        **PARKED,
        "model": str(root / "model"),
        "calibration": {**PARKED["calibration"], "dataset": str(root / "text.txt")},
        "evaluation": {**PARKED["evaluation"], "perplexity": [str(root / "text.txt")]},
    }
    job = run_forged(client, settings, keys["alice"], body, model=str(root / "escape"))
    assert job["status"] == "failed" and job["error"]["code"] == "input_not_allowed", job
    assert "CASP_ALLOWED_MODEL_ROOTS" in job["error"]["message"]

    # The same job with a calibration file that leads out of the root through a symbolic link.
    with session_scope(settings.database) as session:
        template = session.get_one(Job, job["id"]).config
    escaped = {**template, "calibration": {**template["calibration"], "dataset": str(root / "escape.txt")}}
    job = run_forged(client, settings, keys["alice"], body, config=escaped)
    assert job["status"] == "failed" and job["error"]["code"] == "input_not_allowed", job


def test_a_hub_id_never_loads_a_same_named_path_from_the_worker_cwd(
    rooted: tuple[TestClient, Settings, Path],
    keys: dict[str, dict[str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`org/tiny` is a symlink to the demo model in the worker's working directory, outside every root, and
    no hub cache holds it: the job must fail as not found, not prune the symlinked model."""
    client, settings, root = rooted
    cwd = tmp_path / "cwd"
    (cwd / "org").mkdir(parents=True)
    (cwd / "org" / "tiny").symlink_to(DEMO_MODEL)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    body = {
        **PARKED,
        "model": "org/tiny",
        "calibration": {**PARKED["calibration"], "dataset": str(root / "text.txt")},
        "evaluation": {**PARKED["evaluation"], "perplexity": [str(root / "text.txt")]},
    }
    job = run_forged(client, settings, keys["alice"], body)
    assert job["status"] == "failed" and job["error"]["code"] == "model_not_found", job
    assert "Hugging Face hub or its cache" in job["error"]["message"]
