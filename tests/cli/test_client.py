"""The Python client's retries against a real local HTTP server, and the client commands' one-line errors when
the service cannot be reached."""

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from casp_cli.client import CaspAPIError, CaspClient
from casp_cli.main import main
from tests.service_fixtures import REPO

JOB = {"id": "job-1", "status": "queued"}
# Answer(status, headers) for the n-th request (0-based) of a method.
Answer = Callable[[str, int], tuple[int, dict[str, str]]]


@contextmanager
def http_server(answer: Answer, delay: float = 0.0) -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server on a loopback port; yields its URL and the methods of the requests it received."""
    received: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _reply(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            received.append(self.command)
            status, headers = answer(self.command, received.count(self.command) - 1)
            time.sleep(delay)
            body = json.dumps(JOB if status < 400 else {"detail": "try later"}).encode()
            self.send_response(status)
            for name, value in {**headers, "Content-Type": "application/json"}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _reply

        def log_message(self, *args: object) -> None:  # keep the test output clean
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: object, client_address: object) -> None:
            pass  # a client that gave up waiting (the timeout test) hangs up before the answer: expected

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def closed_port_url() -> str:
    """A loopback URL nothing listens on: bound, then closed."""
    with http_server(lambda method, n: (200, {})) as (url, _):
        pass
    return url


def unavailable_for(first: int, headers: dict[str, str] | None = None) -> Answer:
    return lambda method, n: (503, headers or {}) if n < first else (200, {})


def test_503_is_retried_with_backoff_until_the_service_answers() -> None:
    with http_server(unavailable_for(2)) as (url, received), CaspClient(url, retries=3, backoff=0.05) as client:
        assert client.get("job-1") == JOB
    assert received == ["GET"] * 3


def test_a_503_that_lasts_comes_back_after_the_last_retry() -> None:
    with (
        http_server(unavailable_for(100)) as (url, received),
        CaspClient(url, retries=2, backoff=0.05) as client,
        pytest.raises(CaspAPIError) as raised,
    ):
        client.get("job-1")
    assert raised.value.status_code == 503
    assert received == ["GET"] * 3


def test_retry_after_is_honoured() -> None:
    with (
        http_server(unavailable_for(1, {"Retry-After": "1"})) as (url, received),
        CaspClient(url, retries=1, backoff=0.01) as client,
    ):
        start = time.monotonic()
        assert client.get("job-1") == JOB
        assert time.monotonic() - start >= 1.0
    assert received == ["GET"] * 2


def test_submit_is_retried_after_a_503() -> None:
    with http_server(unavailable_for(1)) as (url, received), CaspClient(url, retries=1, backoff=0.05) as client:
        assert client.submit({"model": "m", "ratio": 0.3}) == JOB
    assert received == ["POST"] * 2


def test_a_submit_that_may_have_arrived_is_sent_again_only_with_an_idempotency_key() -> None:
    # The server answers too late: the request reached it, so a second copy could make a second job.
    with (
        http_server(lambda method, n: (201, {}), delay=0.5) as (url, received),
        CaspClient(url, timeout=0.2, retries=2, backoff=0.01) as client,
    ):
        with pytest.raises(httpx.ReadTimeout):
            client.submit({"model": "m", "ratio": 0.3})
        assert received == ["POST"]
        with pytest.raises(httpx.ReadTimeout):
            client.submit({"model": "m", "ratio": 0.3}, idempotency_key="one-job")
        assert received == ["POST"] * 4


def test_an_unreachable_service_fails_after_a_bounded_number_of_attempts() -> None:
    with CaspClient(closed_port_url(), retries=2, backoff=0.05) as client, pytest.raises(httpx.ConnectError) as raised:
        client.get("job-1")
    assert raised.value.__notes__[0].startswith("3 attempts in ")


@pytest.mark.parametrize(
    "command",
    [
        ["status", "job-1"],
        ["wait", "job-1"],
        ["download", "job-1"],
        ["submit", "--model", "org/name", "--ratio", "0.3"],
    ],
)
def test_client_commands_say_in_one_line_that_the_service_is_unreachable(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = closed_port_url()
    assert main([*command, "--url", url, "--retries", "1"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("casp: error: service_unreachable: ") and url in lines[0], lines[0]
    assert "Connection refused (2 attempts in " in lines[0]
    assert captured.out == ""


def test_casp_status_with_default_retries_gives_up_within_seconds() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "casp_cli.main", "status", "job-1", "--url", closed_port_url()],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert completed.returncode == 1
    assert "Traceback" not in completed.stderr and len(completed.stderr.strip().splitlines()) == 1
    assert "service_unreachable" in completed.stderr and "4 attempts" in completed.stderr
    assert elapsed < 20, elapsed  # 0.5 + 1 + 2 s of backoff (plus jitter) and the interpreter's start


def test_a_request_body_file_that_cannot_be_read_gets_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "job.json"
    assert main(["submit", "--json", str(missing), "--url", closed_port_url()]) == 2
    assert capsys.readouterr().err == f"casp: error: invalid_config: --json {missing}: " + (
        f"[Errno 2] No such file or directory: '{missing}'\n"
    )
