"""Real components for the tests of service/, api/, worker/ and the `casp` command (tests/service, tests/api,
tests/worker, tests/cli): PostgreSQL, Redis, a SeaweedFS S3 server, Celery worker processes. A pytest plugin
(tests/conftest.py loads it), so that every one of those folders has the fixtures; import the helpers from here.

PostgreSQL and Redis are started by scripts/services.sh when down; each test session gets its own database,
Redis database and bucket, so it can run beside other sessions on the same machine.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis
from fastapi.testclient import TestClient

from casp_cli.app import service_app
from service import api_keys
from service.db import session_scope
from service.migrate import upgrade
from service.settings import Settings
from worker import runner

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "demo" / "stories260K"
FIXTURE_DATA = (REPO.parent / "shared" / "fixtures" / "data").resolve()
# The real pretrained model's folder (tests/worker/test_real_model.py), allowed beside the demo.
SMOLLM2_FOLDER = (REPO.parent / "shared" / "fixtures" / "models" / "smollm2-135m-instruct-gguf").resolve()
if not FIXTURE_DATA.is_dir():
    FIXTURE_DATA = Path("/work/shared/fixtures/data")
PG_ADMIN_URL = os.environ.get("CASP_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("CASP_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
S3_ACCESS, S3_SECRET = "casp-test-access", "casp-test-secret"
# A bucket of models beside the artifacts' (tests/worker/test_model_sources.py), of which jobs may read one folder.
MODELS_BUCKET, ALLOWED_MODELS_PREFIX = "casp-models", "allowed"
JOB_TIMEOUT = 300.0

# Small settings that still run every stage of the real pipeline on the real demo model in seconds; the
# perplexity is taken on the first 8 windows (the whole test set takes minutes on a busy CPU).
SMALL_JOB: dict[str, Any] = {
    "model": str(DEMO_MODEL),
    "ratio": 0.3,
    "device": "cpu",
    "calibration": {"dataset": "wikitext2:validation", "n_samples": 8, "seq_len": 128},
    "evaluation": {"perplexity": ["wikitext2"], "seq_len": 128, "limit": 8},
}

# Less still, for tests that run several jobs or only need artifacts: every stage but evaluation, in seconds
# on a busy machine. No device: the server's default (`auto`) picks the queue.
TINY_JOB: dict[str, Any] = {
    "model": str(DEMO_MODEL),
    "ratio": 0.3,
    "calibration": {"dataset": "wikitext2:validation", "n_samples": 2, "seq_len": 32},
    "evaluation": {"perplexity": []},
}

# The tiny job with a zero-shot task (arc_easy, its first 20 documents): log-likelihoods kept and copied, and the
# harness's progress bars drawn.
ZERO_SHOT_JOB: dict[str, Any] = {
    **TINY_JOB,
    "device": "cpu",
    "evaluation": {"perplexity": [], "zero_shot": ["arc_easy"], "limit": 20},
}
# What the harness draws for a zero-shot task ("  0%|          | 0/20 [00:00<?, ?it/s]"), which a JSON log does
# without.
PROGRESS_BAR = re.compile(r"\d+/\d+ \[\d+:\d+")

# A job that runs until it is cancelled, however fast the machine: after the tiny job's stages, LoRA recovery of a
# million one-sequence steps, each checking for a cancel before its forward pass (a job that merely takes long
# may end before a test's cancel reaches it on a quick machine).
RUNS_UNTIL_CANCELLED: dict[str, Any] = {
    **TINY_JOB,
    "device": "cpu",
    "recovery": {
        "method": "lora",
        "dataset": "wikitext2:validation",
        "max_steps": 1_000_000,
        "batch_size": 1,
        "grad_accum": 1,
        "max_seq_len": 32,
        "save_every": 1_000_000,
    },
}

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` behind a real uvicorn server on a loopback port, in a thread: for tests that need requests at the same
    time, or streams held open (the TestClient runs one request to its end before the next); yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), 60, "uvicorn")
        assert thread.is_alive(), "uvicorn stopped at start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _services_up() -> bool:
    try:
        with psycopg.connect(PG_ADMIN_URL, connect_timeout=2):
            pass
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def local_services() -> None:
    if not _services_up():
        subprocess.run(["bash", str(REPO / "scripts" / "services.sh")], check=True)
    assert _services_up(), "PostgreSQL or Redis is unreachable even after scripts/services.sh"


@pytest.fixture(scope="session")
def pg_database(local_services: None) -> Iterator[Callable[[], str]]:
    """A factory of fresh, empty PostgreSQL databases (dropped at the end of the session)."""
    created: list[str] = []

    def make() -> str:
        name = f"casp_test_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        created.append(name)
        return PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"

    yield make
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        for name in created:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _start_seaweed(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`weed server` (master, volume, filer, S3) on free ports under `root`; its output goes to root/weed.log."""
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    config = root / "s3.json"
    identity = {"name": "casp", "credentials": [{"accessKey": S3_ACCESS, "secretKey": S3_SECRET}]}
    identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
    config.write_text(json.dumps({"identities": [identity]}))
    # SeaweedFS grows several volumes at a time per bucket: room for 30 of 128 MB (nothing is preallocated), for the
    # run's jobs together with the real model's two checkpoints of about 0.5 GB each (tests/worker/test_real_model.py).
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
    grpc = {name: free_port() for name in ports}
    args = [
        weed, "server", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
        f"-master.port={ports['master']}", f"-master.port.grpc={grpc['master']}",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={grpc['volume']}", "-volume.max=30",
        "-master.volumeSizeLimitMB=128", "-filer", f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={grpc['filer']}", "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={grpc['s3']}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
    ]  # fmt: skip
    with (root / "weed.log").open("wb") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return process, f"http://127.0.0.1:{ports['s3']}"


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it may have exited by itself
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _create_bucket(process: subprocess.Popen[bytes], client: Any, bucket: str, timeout: float) -> None:
    """Create `bucket` once the S3 server answers; the error names the last answer it gave."""
    last_error = "no answer"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"weed exited with {process.returncode}")
        try:
            client.create_bucket(Bucket=bucket)
            return
        except client.exceptions.BucketAlreadyOwnedByYou:
            return
        except Exception as error:
            last_error = f"{type(error).__name__}: {error}"
        time.sleep(0.5)
    raise TimeoutError(f"gave up after {timeout:.0f} s waiting for the S3 server (last error: {last_error})")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real S3 API (SeaweedFS) that checks signatures and expiry, with a fresh bucket.

    A start that does not serve within 90 s is killed and tried again on fresh ports and a fresh folder (a
    port picked free can be taken by the time weed binds it); after three, the error carries weed's last words.
    """
    import boto3

    bucket = "casp-test"
    failures: list[str] = []
    for _ in range(3):
        root = tmp_path_factory.mktemp("seaweed")
        process, endpoint = _start_seaweed(root)
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=S3_ACCESS,
            aws_secret_access_key=S3_SECRET,
            region_name="us-east-1",
        )
        try:
            _create_bucket(process, client, bucket, timeout=90)
        except (TimeoutError, RuntimeError) as error:
            _stop_group(process)
            failures.append(f"{error}\n{(root / 'weed.log').read_text(errors='replace')[-3000:]}")
            continue
        try:
            yield {"endpoint": endpoint, "bucket": bucket}
        finally:
            _stop_group(process)
        return
    pytest.fail("SeaweedFS did not start in three tries:\n" + "\n---\n".join(failures), pytrace=False)


@pytest.fixture(scope="session")
def models_bucket(s3_server: dict[str, str]) -> tuple[Any, Any]:
    """(a boto3 client, its credentials) of MODELS_BUCKET on the test S3 server, the bucket created."""
    from service.settings import S3Credentials
    from service.storage import s3_client

    credentials = S3Credentials(
        endpoint_url=s3_server["endpoint"], access_key_id=S3_ACCESS, secret_access_key=S3_SECRET
    )
    client = s3_client(credentials)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=MODELS_BUCKET)
    return client, credentials


def put_model(models_bucket: tuple[Any, Any], prefix: str, folder: Path = DEMO_MODEL) -> None:
    """The model folder's files as objects under `prefix/` of MODELS_BUCKET."""
    client, _ = models_bucket
    for path in sorted(folder.iterdir()):
        client.upload_file(str(path), MODELS_BUCKET, f"{prefix}/{path.name}")


@pytest.fixture(scope="session")
def distributed_settings(
    pg_database: Callable[[], str], s3_server: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Settings:
    """PostgreSQL, Redis and S3, with short heartbeat and reaper periods so recovery shows within seconds. Its
    workers share the run's per-model cache (CASP_CACHE_DIR, tests/conftest.py): the SmolLM2 GGUF is dequantized
    once for the whole run."""
    redis.Redis.from_url(REDIS_URL).flushdb()
    database = pg_database()
    upgrade(database)
    return Settings(
        home=tmp_path_factory.mktemp("casp-home"),
        database_url=database,
        broker_url=REDIS_URL,
        storage_url=f"s3://{s3_server['bucket']}/artifacts",
        s3_endpoint_url=s3_server["endpoint"],
        s3_access_key_id=S3_ACCESS,
        s3_secret_access_key=S3_SECRET,
        allowed_model_roots=[REPO / "demo", SMOLLM2_FOLDER],
        allowed_model_buckets=[f"{MODELS_BUCKET}/{ALLOWED_MODELS_PREFIX}"],
        datasets_dir=FIXTURE_DATA,
        auth="apikey",
        secret_key="test-signing-secret",
        heartbeat_interval_seconds=1.0,
        heartbeat_timeout_seconds=6.0,
        reaper_interval_seconds=1.0,
        max_attempts=3,
        default_device="cpu",
        # The tests park many jobs per key: the fair-use tests give their keys limits of their own.
        max_active_jobs=1000,
        max_submissions_per_minute=1000,
        # As docker-compose.yml runs the service: the worker processes write JSON lines (tests/worker read them).
        log_format="json",
    )


class RedisServer:
    """A redis-server of this test alone, without persistence like the shared one: a restart empties it."""

    def __init__(self, port: int, log: Path) -> None:
        self.port = port
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        client = redis.Redis(port=self.port, socket_connect_timeout=1)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        wait_for(up, 20, "redis-server")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(20)


def private_broker_settings(root: Path, database: str, broker: RedisServer, **changes: Any) -> Settings:
    """PostgreSQL with a redis-server of the test's own and local storage under `root`: for tests that stop the
    broker or must be sure no other worker takes their jobs."""
    defaults: dict[str, Any] = {
        "home": root / "home",
        "cache_dir": root / "home" / "cache",
        "database_url": database,
        "broker_url": f"redis://127.0.0.1:{broker.port}/0",
        "storage_url": f"file://{root / 'artifacts'}",
        "allowed_model_roots": [REPO / "demo"],
        "datasets_dir": FIXTURE_DATA,
        "auth": "none",
        "secret_key": "test-signing-secret",
    }
    return Settings(**{**defaults, **changes})


def embedded_settings(home: Path, **changes: Any) -> Settings:
    """The embedded mode (SQLite, local storage, no auth) with no worker threads: a test runs jobs by hand. Its
    per-model cache is its own (not the run's CASP_CACHE_DIR), so what it finds there is what it made."""
    defaults: dict[str, Any] = {
        "cache_dir": home / "cache",
        "auth": "none",
        "allowed_model_roots": [REPO / "demo"],
        "datasets_dir": FIXTURE_DATA,
        "embedded_workers": 0,
    }
    settings = Settings(home=home, **{**defaults, **changes})
    upgrade(settings.database)
    return settings


def counted_retry_saves(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the retry-state files the worker stores from now on, in order (each stored as before)."""
    stored: list[str] = []
    keep = runner._keep_retry_state

    def keep_and_count(storage: Any, job_id: str, path: Path) -> None:
        keep(storage, job_id, path)
        stored.append(path.name)

    monkeypatch.setattr(runner, "_keep_retry_state", keep_and_count)
    return stored


def process_env(variables: dict[str, str]) -> dict[str, str]:
    """This process's environment with these CASP_* variables alone (and the repository importable), as a process
    manager would start a command."""
    return {k: v for k, v in os.environ.items() if not k.startswith("CASP_")} | variables | {"PYTHONPATH": str(REPO)}


def started_with(arguments: list[str], variables: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A command (`python -c ...`, `-m casp_cli.main ...`) run to its end from the repository with these CASP_*
    variables alone; its output captured."""
    env = process_env(variables)
    return subprocess.run([sys.executable, *arguments], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def settings_env(settings: Settings) -> dict[str, str]:
    """The same settings as CASP_* variables, for processes started from the tests."""
    variables = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if name == "allowed_model_roots":
            value = ":".join(map(str, value))
        elif isinstance(value, list):  # the comma-separated settings
            value = ",".join(value)
        elif isinstance(value, dict):  # JSON, as pydantic-settings reads it
            value = json.dumps(value)
        variables[f"CASP_{name.upper()}"] = str(value)
    return process_env(variables)


class WorkerProcess:
    """`casp worker` as a separate process group, so a test can SIGKILL it (parent and pool child) at once."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "casp_cli.main", "worker", "--device", "cpu", "--log-level", "info"],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def ready() -> bool:
            assert self.process is not None and self.process.poll() is None, self.log_tail()
            return b"ready." in self.log_path.read_bytes()[offset:]

        wait_for(ready, 90, "the Celery worker")

    def kill(self) -> None:
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


@pytest.fixture(scope="session")
def worker(distributed_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    process = WorkerProcess(settings_env(distributed_settings), tmp_path_factory.mktemp("worker") / "worker.log")
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def api(distributed_settings: Settings) -> Iterator[TestClient]:
    """The API in this process (with its reaper thread), against the shared database, broker and bucket. It
    stops with each module that uses it: its reaper talks to Redis every second, which later tests that assert
    no network use would see. (A "package" fixture defined in a plugin lives as long as the session.)"""
    with TestClient(service_app(distributed_settings)) as client:
        yield client


@pytest.fixture(scope="session")
def keys(distributed_settings: Settings) -> dict[str, dict[str, str]]:
    """Two API keys, as ready-made Authorization headers."""
    headers = {}
    with session_scope(distributed_settings.database) as session:
        for name in ("alice", "bob"):
            _, key = api_keys.create_api_key(session, name)
            headers[name] = {"Authorization": f"Bearer {key}"}
    return headers


def wait_job(
    client: TestClient,
    job_id: str,
    headers: dict[str, str],
    until: Callable[[dict[str, Any]], bool],
    what: str,
    timeout: float = JOB_TIMEOUT,
) -> dict[str, Any]:
    def poll() -> dict[str, Any] | None:
        job = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
        return job if until(job) else None

    return wait_for(poll, timeout, what, interval=0.25)


def finished(job: dict[str, Any]) -> bool:
    return job["status"] in ("succeeded", "failed", "cancelled")


def expected_parameters(result: dict[str, Any]) -> int:
    """Parameters the pruned checkpoint must have: the dense demo model's, less what the report says was
    removed (the report counts the prunable decoder parameters only)."""
    from transformers import AutoModelForCausalLM

    dense = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(DEMO_MODEL).parameters())
    return dense - (result["params"]["dense"] - result["params"]["pruned"])


def download(url: str) -> httpx.Response:
    return httpx.get(url, timeout=30)


def download_artifacts(client: TestClient, job_id: str, headers: dict[str, str], folder: Path) -> list[dict[str, Any]]:
    """Every artifact of the job into `folder` by its presigned URL (no API key, no S3 credentials), each checked
    against its listed size and sha256; returns the listing."""
    artifacts: list[dict[str, Any]] = client.get(f"/v1/jobs/{job_id}/artifacts", headers=headers).json()["data"]
    for artifact in artifacts:
        response = download(artifact["url"])
        assert response.status_code == 200, artifact["name"]
        assert len(response.content) == artifact["size"]
        assert hashlib.sha256(response.content).hexdigest() == artifact["sha256"]
        path = folder / artifact["name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(response.content)
    return artifacts
