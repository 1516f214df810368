"""CASP_WEBHOOK_SECRET's two forms: `whsec_<base64>` read as the Standard Webhooks libraries read it, any other
string as its UTF-8 bytes; a `whsec_` secret that is not base64 refused at start in one line; `casp webhooks
secret` prints a new one in the specification's form. Deliveries themselves: tests/service/test_webhooks.py."""

import base64
import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from casp_cli.main import main
from service.settings import Settings
from service.webhooks import NEW_SECRET_BYTES, standard_headers
from tests.service_fixtures import started_with

BODY = b'{"id":"job-1","status":"succeeded"}'


def casp_signed(secret: str) -> tuple[dict[str, str], bytes]:
    """The headers casp sends with BODY under this CASP_WEBHOOK_SECRET, and the key it signed with."""
    key = Settings(webhook_secret=secret).webhook_key
    assert key is not None
    return standard_headers(key, "job-1.job.succeeded", int(time.time()), BODY), key


def test_a_whsec_secret_is_keyed_as_the_standard_webhooks_library_reads_it() -> None:
    key = bytes(range(24))
    padded = "whsec_" + base64.b64encode(key).decode()
    unpadded = "whsec_" + base64.b64encode(key[:-1]).decode().rstrip("=")
    assert unpadded != "whsec_" + base64.b64encode(key[:-1]).decode()  # it did have padding to leave out
    for secret, expected in ((padded, key), (unpadded, key[:-1])):
        headers, signing_key = casp_signed(secret)
        assert signing_key == expected
        # The receiver's library, given the very string casp has, takes the delivery and refuses a tampered one.
        assert Webhook(secret).verify(BODY, headers)["status"] == "succeeded"
        with pytest.raises(WebhookVerificationError):
            Webhook(secret).verify(BODY.replace(b"succeeded", b"failed"), headers)
        # Not keyed with the whole string's bytes, as casp did before.
        with pytest.raises(WebhookVerificationError):
            Webhook(secret.encode()).verify(BODY, headers)
    # Without the prefix the string is raw, as before: its UTF-8 bytes are the key.
    raw = "whsec-raw secret, ünïcode"
    headers, signing_key = casp_signed(raw)
    assert signing_key == raw.encode()
    assert Webhook(raw.encode()).verify(BODY, headers)["id"] == "job-1"


@pytest.mark.parametrize(
    ("secret", "reason"),
    [
        ("whsec_not base64!", "what follows whsec_ here is not base64"),
        ("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw-_", "what follows whsec_ here is not base64"),  # URL-safe alphabet
        ("whsec_abcde", "what follows whsec_ here is not base64"),  # 5 characters: no whole byte in the last one
        ("whsec_", "nothing follows whsec_ here"),
    ],
)
def test_a_whsec_secret_that_is_not_base64_is_refused(secret: str, reason: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(webhook_secret=secret)
    assert reason in str(refused.value)
    assert "input_value" not in str(refused.value)  # pydantic would show the secret (and so its traceback)


def test_casp_serve_refuses_a_whsec_secret_that_is_not_base64_in_one_line(tmp_path: Path) -> None:
    variables = {"CASP_HOME": str(tmp_path / "home"), "CASP_WEBHOOK_SECRET": "whsec_this is not base64"}
    served = started_with(["-m", "casp_cli.main", "serve", "--port", "0"], variables)
    assert served.returncode == 2
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1, served.stderr
    assert lines[0].startswith("casp: error: invalid_config: CASP_WEBHOOK_SECRET: a whsec_ secret is the Standard")
    assert "not base64" in lines[0] and "this is not base64" not in lines[0]
    assert not (tmp_path / "home").exists()  # refused before anything was set up


def test_the_api_factory_and_the_celery_app_refuse_a_wrong_variable_as_casp_serve_does(tmp_path: Path) -> None:
    # What docker-compose's or a user's own process manager starts without `casp serve` or `casp worker`: uvicorn's
    # `api.main:create_app --factory` and `celery -A worker.tasks`; one process tries both (each import costs ~10 s).
    script = """
from casp_core.errors import InvalidConfig
for start in ("from api.main import create_app; create_app()", "import worker.tasks"):
    try:
        exec(start)
    except InvalidConfig as refused:
        print(refused.message)
"""
    variables = {"CASP_HOME": str(tmp_path / "home"), "CASP_WEBHOOK_SECRET": "whsec_this is not base64"}
    ran = started_with(["-c", script], variables)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert len(lines) == 2, ran.stdout
    for line in lines:
        assert line.startswith("CASP_WEBHOOK_SECRET: a whsec_ secret is the Standard"), line
        assert "this is not base64" not in line


def test_casp_webhooks_secret_prints_a_new_secret_in_the_specifications_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    printed = []
    for _ in range(2):
        assert main(["webhooks", "secret"]) == 0
        out = capsys.readouterr().out
        assert out.endswith("\n") and len(out.splitlines()) == 1
        printed.append(out.strip())
    assert printed[0] != printed[1]
    for secret in printed:
        assert secret.startswith("whsec_")
        assert len(base64.b64decode(secret.removeprefix("whsec_"), validate=True)) == NEW_SECRET_BYTES
        headers, _ = casp_signed(secret)
        assert Webhook(secret).verify(BODY, headers)["id"] == "job-1"
