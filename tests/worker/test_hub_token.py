"""A key's hub token: set with `casp keys set-hub-token` or by the key itself (`PUT /v1/keys/me/hub-token`), stored
encrypted, handed to casp_core's loader for that key's jobs only, and nowhere in the job's record: its row, events,
result, artifacts (report, model card) and logs. Hub access is offline here: the job prunes a local folder, and the
loader's own call records the token it got."""

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from api.main import create_app
from service import api_keys
from service.db import session_scope
from service.security import decrypt_hub_token
from service.settings import Settings
from service.storage import make_storage
from service.tables import ApiKey, Job
from tests.api.test_api import refusal
from tests.service_fixtures import REPO, TINY_JOB, embedded_settings, settings_env
from worker.runner import execute

pytestmark = pytest.mark.service

TOKEN = "hf_casp_test_token_" + "x7Q2" * 6


def with_two_keys(home: Path) -> tuple[Settings, tuple[str, str], tuple[str, str]]:
    """An embedded service with API keys, and two keys: (id, key) of alice, of bob."""
    settings = embedded_settings(home, auth="apikey", secret_key="hub-token-test-secret")
    with session_scope(settings.database) as session:
        (alice, alice_key), (bob, bob_key) = (
            api_keys.create_api_key(session, "alice"),
            api_keys.create_api_key(session, "bob"),
        )
        return settings, (alice.id, alice_key), (bob.id, bob_key)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def recorded_loads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The token of each call of the real loader, in order."""
    loads: list[Any] = []
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def recording(*args: Any, **kwargs: Any) -> Any:
        loads.append(kwargs.get("token"))
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    return loads


def run_job(client: TestClient, settings: Settings, headers: dict[str, str]) -> list[str]:
    """Runs a job of the key's to success; what a client can read of it: the job, its events, its artifacts."""
    job_id = client.post("/v1/jobs", json={**TINY_JOB, "device": "cpu"}, headers=headers).json()["id"]
    assert execute(job_id, settings, make_storage(settings), worker_id="by-hand") == "succeeded"
    records = [client.get(f"/v1/jobs/{job_id}", headers=headers).text]
    records.append(client.get(f"/v1/jobs/{job_id}/events", headers=headers).text)
    for artifact in client.get(f"/v1/jobs/{job_id}/artifacts", headers=headers).json()["data"]:
        records.append(client.get(artifact["url"]).content.decode(errors="replace"))
    return records


def test_the_hub_token_reaches_the_loader_of_its_keys_jobs_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings, (alice_id, alice_key), (_, bob_key) = with_two_keys(tmp_path)
    stored = subprocess.run(
        [sys.executable, "-m", "casp_cli.main", "keys", "set-hub-token", alice_id],
        cwd=REPO,
        env=settings_env(settings),
        input=TOKEN + "\n",
        capture_output=True,
        text=True,
    )
    assert stored.returncode == 0 and TOKEN not in stored.stdout + stored.stderr, stored.stderr
    with session_scope(settings.database) as session:
        encrypted = session.get_one(ApiKey, alice_id).hub_token
    assert encrypted and TOKEN not in encrypted
    assert decrypt_hub_token(settings.verification_keys, encrypted) == TOKEN

    loads = recorded_loads(monkeypatch)  # the real loader, which records the token each call got
    caplog.set_level(logging.DEBUG)
    with TestClient(create_app(settings)) as client:
        records = [record for key in (alice_key, bob_key) for record in run_job(client, settings, bearer(key))]
    assert loads == [TOKEN, None]  # alice's job had her token; bob's, none
    with session_scope(settings.database) as session:
        rows = session.query(Job).all()
        records += [repr(vars(row)) for row in rows]
    records.append(caplog.text)
    assert len(records) > 10 and any("README" in record or "base_model" in record for record in records)
    for record in records:
        assert TOKEN not in record and encrypted not in record


def test_a_token_no_secret_decrypts_fails_the_job_with_its_code(tmp_path: Path) -> None:
    settings = embedded_settings(tmp_path, auth="apikey", secret_key="hub-token-test-secret")
    with session_scope(settings.database) as session:
        row, key = api_keys.create_api_key(session, "carol")
        key_id = row.id
    subprocess.run(
        [sys.executable, "-m", "casp_cli.main", "keys", "set-hub-token", key_id],
        cwd=REPO,
        env=settings_env(settings),
        input=TOKEN,
        check=True,
        capture_output=True,
        text=True,
    )
    # The secret is rotated, and the old one dropped from CASP_PREVIOUS_SECRET_KEYS.
    rotated = settings.model_copy(update={"secret_key": "another-secret"})
    rotated.__dict__.pop("signing_key", None)
    with TestClient(create_app(rotated)) as client:
        headers = {"Authorization": f"Bearer {key}"}
        job_id = client.post("/v1/jobs", json={**TINY_JOB, "device": "cpu"}, headers=headers).json()["id"]
        assert execute(job_id, rotated, make_storage(rotated), worker_id="by-hand") == "failed"
        error = client.get(f"/v1/jobs/{job_id}", headers=headers).json()["error"]
    assert error["code"] == "hub_token_unreadable" and "casp keys set-hub-token" in error["message"]
    # With the old secret among the previous ones, the token reads again.
    kept = rotated.model_copy(update={"previous_secret_keys": ["hub-token-test-secret"]})
    with session_scope(kept.database) as session:
        assert decrypt_hub_token(kept.verification_keys, session.get_one(ApiKey, key_id).hub_token or "") == TOKEN


@pytest.mark.slow
def test_a_key_sets_and_clears_its_own_hub_token_through_the_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings, (alice_id, alice_key), (bob_id, bob_key) = with_two_keys(tmp_path)
    alice_headers, bob_headers = bearer(alice_key), bearer(bob_key)
    loads = recorded_loads(monkeypatch)
    caplog.set_level(logging.DEBUG)
    with TestClient(create_app(settings)) as client:
        stored = client.put("/v1/keys/me/hub-token", json={"token": TOKEN}, headers=alice_headers)
        assert stored.status_code == 204 and stored.content == b""  # never answered back
        with session_scope(settings.database) as session:
            encrypted = session.get_one(ApiKey, alice_id).hub_token
            assert session.get_one(ApiKey, bob_id).hub_token is None
        assert encrypted and TOKEN not in encrypted
        assert decrypt_hub_token(settings.verification_keys, encrypted) == TOKEN
        records = run_job(client, settings, alice_headers) + run_job(client, settings, bob_headers)
        records.append(client.get("/v1/usage", headers=alice_headers).text)

        for bad in ({"token": ""}, {"token": TOKEN + " x"}, {"token": 12}, {"token": TOKEN, "other": 1}, {}):
            error = refusal(client.put("/v1/keys/me/hub-token", json=bad, headers=alice_headers))
            assert error["param"] in ("token", "other"), error
            records.append(error["message"])
        assert refusal(client.put("/v1/keys/me/hub-token", json={"token": TOKEN}), 401)["code"] == "unauthorized"

        assert client.delete("/v1/keys/me/hub-token", headers=alice_headers).status_code == 204
        with session_scope(settings.database) as session:
            assert session.get_one(ApiKey, alice_id).hub_token is None
        records += run_job(client, settings, alice_headers)
    assert loads == [TOKEN, None, None]  # alice's job with it, bob's without, alice's after she cleared it
    with session_scope(settings.database) as session:
        records += [repr(vars(row)) for row in session.query(Job).all()]
    records.append(caplog.text)
    for record in records:
        assert TOKEN not in record and encrypted not in record

    (tmp_path / "open").mkdir()
    without_keys = embedded_settings(tmp_path / "open", auth="none")
    with TestClient(create_app(without_keys)) as client:
        error = refusal(client.put("/v1/keys/me/hub-token", json={"token": TOKEN}), 400)
    assert "CASP_AUTH=none" in error["message"]
