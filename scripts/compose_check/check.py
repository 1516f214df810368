"""Builds the image and runs docker-compose.yml for real, then drives a job through it from the host.

    .venv/bin/python scripts/compose_check/check.py [--work DIR] [--keep]     # after `make install`

Needs a Docker engine, docker-compose and debootstrap (Debian: `apt-get install docker.io docker-compose
debootstrap`, then `dockerd &`); no GPU and no container registry: derive.py says what it swaps for that. Steps:
1. a Debian base image from debootstrap, and the stand-ins of standins.Dockerfile on it;
2. `docker-compose config` of the real file -> derive.py -> `docker-compose up -d --build`; wait until the api
   and the worker report healthy;
3. an API key through `docker-compose exec api ... keys create`; a job on stories260K submitted from the host,
   polled to succeeded, every artifact downloaded by its presigned URL with its sha256 checked, the checkpoint
   loaded and run;
4. a second job whose worker container is killed (SIGKILL) while it runs: the restart policy brings the
   worker back and the job still succeeds;
5. `down` and `up` again: the jobs and their artifacts are still there (volumes);
6. `down -v` unless --keep. A summary goes to WORK/result.json.
"""

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from casp_cli.client import CaspClient  # noqa: E402
from casp_cli.main import demo_request  # noqa: E402
from casp_core.artifacts.checkpoint import load_pruned  # noqa: E402
from tests.service_fixtures import wait_for  # noqa: E402

DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = "python3,python3-venv,ca-certificates,redis-server,redis-tools,postgresql,procps"
STANDINS = ("python", "redis", "postgres", "s3")
API_URL = "http://localhost:8000"
PROJECT = "casp-check"


def run(*args: str | Path, capture: bool = False, env: dict[str, str] | None = None, stdin: str | None = None) -> str:
    print("+", " ".join(str(a) for a in args), flush=True)
    result = subprocess.run([str(a) for a in args], check=True, text=True, capture_output=capture, env=env, input=stdin)
    return result.stdout if capture else ""


def build_standins(work: Path) -> None:
    """The debootstrapped base (once per machine) and the stand-in images on top of it."""
    base = "casp-check/debian:bookworm"
    if subprocess.run(["docker", "image", "inspect", base], capture_output=True).returncode != 0:
        rootfs = work / "rootfs"
        run("debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", rootfs, DEBIAN_MIRROR)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", base], stdin=tar.stdout, check=True)
        tar.wait()
        shutil.rmtree(rootfs)
    context = work / "standins"
    shutil.rmtree(context, ignore_errors=True)
    shutil.copytree(HERE, context, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", context)
    for target in STANDINS:
        run("docker", "build", "-q", "--target", target, "-t", f"casp-check/{target}", "-f",
            context / "standins.Dockerfile", context)  # fmt: skip


class Compose:
    def __init__(self, file: Path) -> None:
        self.base = ["docker-compose", "-p", PROJECT, "-f", str(file)]

    def __call__(self, *args: str, capture: bool = False) -> str:
        return run(*self.base, *args, capture=capture)

    def container(self, service: str) -> str:
        return self("ps", "-q", service, capture=True).strip()

    def health(self, service: str) -> str:
        container = self.container(service)
        if not container:
            return "absent"
        state = json.loads(run("docker", "inspect", "-f", "{{json .State}}", container, capture=True))
        return state.get("Health", {}).get("Status", state["Status"])

    def wait_healthy(self, services: tuple[str, ...], timeout: float) -> None:
        for service in services:
            wait_for(
                lambda service=service: self.health(service) == "healthy", timeout, f"{service} healthy", interval=5
            )


def prepare_work(work: Path) -> Path:
    """models/ and datasets/ for the mounts, and the derived compose file; returns its path."""
    for name, source in (("models/stories260K", REPO / "demo/stories260K"), ("datasets", REPO / "demo/datasets")):
        shutil.rmtree(work / name, ignore_errors=True)
        shutil.copytree(source, work / name)
    env = {**os.environ, "CASP_SECRET_KEY": secrets.token_hex(32)}
    config = run("docker-compose", "-f", REPO / "docker-compose.yml", "config", capture=True, env=env)
    derived = run(sys.executable, HERE / "derive.py", "--work", work, capture=True, stdin=config)
    file = work / "docker-compose.check.yml"
    file.write_text(derived)
    return file


def check_job(client: CaspClient, job: dict[str, Any], out: Path) -> dict[str, Any]:
    """A succeeded job's artifacts downloaded (sha256 checked by the client) and its checkpoint run."""
    import torch

    assert job["status"] == "succeeded", job
    events = client.events(job["id"])["data"]
    assert [event["id"] for event in events] == sorted(event["id"] for event in events)
    paths = client.download(job["id"], out)
    model, tokenizer = load_pruned(out)
    prompt = tokenizer("Once upon a time", return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**prompt).logits).all()
        generated = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    return {
        "id": job["id"],
        "attempts": job["attempts"],
        "artifacts": len(paths),
        "parameters_loaded": sum(p.numel() for p in model.parameters()),
        "greedy_continuation": tokenizer.decode(generated[0], skip_special_tokens=True),
        "result": job["result"],
        "events": len(events),
    }


def kill_worker_mid_job(compose: Compose, client: CaspClient, request: dict[str, Any]) -> dict[str, Any]:
    """Submits a job, SIGKILLs the worker container's main process once the job is inside a stage, and waits."""
    job = client.submit(request)
    wait_for(lambda: client.get(job["id"])["stage"] is not None, 300, "second job in a stage", interval=0.2)
    container = compose.container("worker")
    pid = int(run("docker", "inspect", "-f", "{{.State.Pid}}", container, capture=True))
    os.kill(pid, signal.SIGKILL)
    at = client.get(job["id"])
    print(f"killed the worker (pid {pid}) during {at['stage']} at {at['progress']:.0f} %", flush=True)
    # The restart policy brings the worker back; the job is redelivered or re-queued by the reaper.
    finished = client.wait(job["id"], timeout=900)
    restarts = int(run("docker", "inspect", "-f", "{{.RestartCount}}", container, capture=True))
    events = client.events(job["id"])["data"]
    return {
        "killed_during": {"stage": at["stage"], "progress": at["progress"]},
        "worker_restarts": restarts,
        "events": [f"attempt {e['attempt']} {e['kind']} {e['status']}: {e['message']}" for e in events],
        "job": finished,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/casp-compose-check"))
    parser.add_argument("--keep", action="store_true", help="leave the stack running (and its volumes)")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    timings: dict[str, float] = {}

    build_standins(work)
    compose = Compose(prepare_work(work))
    timings["stand-ins"] = time.monotonic() - started
    summary: dict[str, Any] = {"docker": run("docker", "version", "-f", "{{.Server.Version}}", capture=True).strip()}
    summary["compose"] = run("docker-compose", "version", "--short", capture=True).strip()
    try:
        compose("up", "-d", "--build")
        compose.wait_healthy(("api", "worker"), timeout=1800)
        timings["build and up"] = time.monotonic() - started - timings["stand-ins"]
        key = compose("exec", "-T", "api", "python", "-m", "casp_cli.main", "keys", "create", "--name", "check",
                      capture=True).strip().splitlines()[-1]  # fmt: skip
        request = {**demo_request(Path("/models/stories260K")), "metadata": {"source": "compose check"}}
        with CaspClient(API_URL, key) as client:
            mark = time.monotonic()
            first = client.wait(client.submit(request)["id"], timeout=900)
            timings["first job"] = time.monotonic() - mark
            summary["first_job"] = check_job(client, first, work / "download" / "first")

            mark = time.monotonic()
            crash = kill_worker_mid_job(compose, client, request)
            second = crash.pop("job")
            timings["killed job"] = time.monotonic() - mark
            summary["killed_worker_job"] = {**check_job(client, second, work / "download" / "second"), **crash}
            assert second["attempts"] >= 2 and crash["worker_restarts"] >= 1, crash

        compose("down")
        compose("up", "-d")
        compose.wait_healthy(("api", "worker"), timeout=600)
        with CaspClient(API_URL, key) as client:
            listed = [job["id"] for job in client.jobs()["data"]]
            assert listed == [second["id"], first["id"]], listed
            summary["after_restart"] = check_job(client, client.get(first["id"]), work / "download" / "restarted")
        summary["ok"] = True
    finally:
        if not args.keep:
            with (work / "logs.txt").open("w") as logs:
                subprocess.run([*compose.base, "logs", "--no-color", "--tail", "200"], stdout=logs)
            compose("down", "-v")
        summary["seconds"] = {name: round(value, 1) for name, value in timings.items()}
        (work / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
