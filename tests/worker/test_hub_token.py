"""A key's hub token: set with `casp keys set-hub-token` (stored encrypted), handed to casp_core's loader for that key's
jobs only, and nowhere in the job's record: its row, events, result, artifacts (report, model card) and logs. Hub
access is offline here: the job prunes a local folder, and the loader's own call records the token it got."""

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from api.main import create_app
from service import jobs
from service.db import session_scope
from service.security import decrypt_hub_token
from service.storage import make_storage
from service.tables import ApiKey, Job
from tests.service_fixtures import REPO, TINY_JOB, embedded_settings, settings_env
from worker.runner import execute

pytestmark = pytest.mark.service

TOKEN = "hf_casp_test_token_" + "x7Q2" * 6


def test_the_hub_token_reaches_the_loader_of_its_keys_jobs_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings = embedded_settings(tmp_path, auth="apikey", secret_key="hub-token-test-secret")
    with session_scope(settings.database) as session:
        (alice, alice_key), (_, bob_key) = jobs.create_api_key(session, "alice"), jobs.create_api_key(session, "bob")
        alice_id = alice.id
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

    # The real loader, which records the token each call got.
    loads: list[Any] = []
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def recording(*args: Any, **kwargs: Any) -> Any:
        loads.append(kwargs.get("token"))
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    caplog.set_level(logging.DEBUG)
    storage = make_storage(settings)
    with TestClient(create_app(settings)) as client:
        records = []
        for key in (alice_key, bob_key):
            headers = {"Authorization": f"Bearer {key}"}
            job_id = client.post("/v1/jobs", json={**TINY_JOB, "device": "cpu"}, headers=headers).json()["id"]
            assert execute(job_id, settings, storage, worker_id="by-hand") == "succeeded"
            records.append(client.get(f"/v1/jobs/{job_id}", headers=headers).text)
            records.append(client.get(f"/v1/jobs/{job_id}/events", headers=headers).text)
            for artifact in client.get(f"/v1/jobs/{job_id}/artifacts", headers=headers).json()["data"]:
                records.append(client.get(artifact["url"]).content.decode(errors="replace"))
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
        row, key = jobs.create_api_key(session, "carol")
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
