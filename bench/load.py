"""Load bench of the jobs service: submissions+cancels per second and status polls per second, with p50/p99
latency and the error count, in the embedded mode (SQLite, local storage) and the distributed one (PostgreSQL,
Redis, local storage).

Each mode starts a real `casp serve` process on a loopback port, with no worker (embedded: no in-process
worker; distributed: none consumes the queue), so that only the API is measured and every job is cancelled
while queued. Client threads, each with its own `CaspClient` (retries off: every error counts), first submit a
job and cancel it (a pair), then poll the jobs' status. Bounded: `--jobs` pairs and `--polls` polls per mode.

Then the event streams (issue 29), on a fresh server: `--streams` Server-Sent Event streams held open at once
by one key over `--stream-jobs` jobs (marked running in the database, as a worker's claim does, so that they do
not end), read by one asyncio loop over raw loopback sockets; one stream more must be refused (429). In
`--stream-rounds` rounds a cancel request on every job writes an event to it (the API writes it: in the
embedded mode only the server's own process notifies its streams); every stream of the job must receive it.
Meanwhile client threads poll the jobs' status. Recorded: each event's delay from the moment its request was
sent to its arrival on each stream, the status polls' latency, and every 5xx.
Writes bench/results/load.json and load.md.
"""

import argparse
import asyncio
import os
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    REPO_ROOT,
    RESULTS_DIR,
    all_finite,
    concurrency_note,
    default_datasets_dir,
    finish_machine_info,
    machine_info,
    machine_line,
    write_json,
)
from casp_cli.client import CaspAPIError, CaspClient
from casp_cli.main import prepare
from service import api_keys, job_queue, jobs
from service.db import session_scope
from service.settings import Settings

MODES = ("embedded", "distributed")
DEMO_MODEL = REPO_ROOT / "demo" / "stories260K"
# A valid request the service accepts; no worker ever runs it.
JOB = {
    "model": str(DEMO_MODEL),
    "ratio": 0.3,
    "device": "cpu",
    "calibration": {"dataset": "wikitext2:validation", "n_samples": 8, "seq_len": 128},
    "evaluation": {"perplexity": ["wikitext2"], "seq_len": 128, "limit": 8},
}
WARMUP_PAIRS = 5  # the first requests pay for imports and connections: not measured


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--jobs", type=int, default=300, help="submit+cancel pairs per mode")
    parser.add_argument("--polls", type=int, default=1000, help="status polls per mode")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads")
    parser.add_argument("--streams", type=int, default=1000, help="event streams held open at once per mode")
    parser.add_argument("--stream-jobs", type=int, default=100, help="jobs the streams follow")
    parser.add_argument("--stream-rounds", type=int, default=5, help="events written to every streamed job")
    parser.add_argument(
        "--pg-admin-url",
        default=os.environ.get("CASP_TEST_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/test"),
        help="distributed mode: a database of its own is created there and dropped at the end",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("CASP_BENCH_REDIS_URL", "redis://127.0.0.1:6379/15"),
        help="distributed mode: a Redis database of its own (emptied before and after)",
    )
    parser.add_argument("--note", default="", help="what else ran on the machine, said with the results")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def postgres_database(admin_url: str) -> Iterator[str]:
    import psycopg

    name = f"casp_load_{secrets.token_hex(6)}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{name}"
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def empty_redis(url: str) -> Iterator[str]:
    """The stale messages of the cancelled jobs stay in the queue (no worker drains them): removed at the end."""
    import redis

    client = redis.Redis.from_url(url)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()


def service_settings(
    mode: str, home: Path, database_url: str | None, broker_url: str | None, max_streams: int = 20
) -> dict[str, str]:
    values = {
        "home": str(home),
        "auth": "apikey",
        "allowed_model_roots": str(DEMO_MODEL.parent),
        "datasets_dir": default_datasets_dir(),
        "default_device": "cpu",
        "embedded_workers": "0",
        "storage_url": f"file://{home / 'artifacts'}",
        "max_streams_per_key": str(max_streams),
    }
    if mode == "distributed":
        assert database_url and broker_url
        values |= {"database_url": database_url, "broker_url": broker_url}
    return values


@contextmanager
def casp_serve(values: dict[str, str], home: Path) -> Iterator[tuple[str, str]]:
    """`casp serve` in its own process group, with an API key; yields (url, key). Its log: home/serve.log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASP_")}
    env |= {f"CASP_{name.upper()}": value for name, value in values.items()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    settings = Settings(**values)  # type: ignore[arg-type]  # pydantic parses the strings, as from CASP_*
    prepare(settings)
    with session_scope(settings.database) as session:
        # Limits of its own far above what the bench sends: it measures the API's throughput (the limit checks
        # still run on every submission), not the fair-use limits.
        _, key = api_keys.create_api_key(
            session, "load-bench", max_active_jobs=1_000_000, max_submissions_per_minute=1_000_000
        )
    port = free_port()
    log_path = home / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "casp_cli.main", "serve", "--port", str(port), "--log-level", "warning"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"casp serve exited: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("casp serve did not answer within 120 s")
            time.sleep(0.2)
        yield url, key
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    if len(seconds) < 2:
        only = 1000 * seconds[0] if seconds else float("nan")
        return {"p50": only, "p99": only, "max": only}
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return {"p50": 1000 * cuts[49], "p99": 1000 * cuts[98], "max": 1000 * max(seconds)}


class Recorder:
    """Latencies per request kind and errors (with a few examples), from every client thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: dict[str, list[float]] = {}
        self.errors: list[str] = []

    def timed(self, kind: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            result = call()
        except (CaspAPIError, httpx.HTTPError) as error:
            with self.lock:
                self.errors.append(f"{kind}: {type(error).__name__}: {error}")
            return None
        elapsed = time.perf_counter() - start
        with self.lock:
            self.latencies.setdefault(kind, []).append(elapsed)
        return result


def run_phase(
    url: str, key: str, concurrency: int, count: int, one: Callable[[CaspClient, int, Recorder], None]
) -> tuple[float, Recorder]:
    """`count` calls of `one`, spread over `concurrency` threads with a client each; returns the wall time."""
    recorder = Recorder()
    clients = [CaspClient(url, api_key=key, retries=0) for _ in range(concurrency)]

    def worker(index: int) -> None:
        for n in range(index, count, concurrency):
            one(clients[index], n, recorder)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(worker, range(concurrency)))
        return time.perf_counter() - start, recorder
    finally:
        for client in clients:
            client.http.close()


def measure_mode(mode: str, args: argparse.Namespace, database_url: str | None, broker_url: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"casp-load-{mode}-") as tmp:
        home = Path(tmp)
        with casp_serve(service_settings(mode, home, database_url, broker_url), home) as (url, key):
            ids: list[str] = []
            statuses: dict[str, int] = {}

            def submit_and_cancel(client: CaspClient, n: int, recorder: Recorder) -> None:
                job = recorder.timed("submit", lambda: client.submit(JOB))
                if job is None:
                    return
                cancelled = recorder.timed("cancel", lambda: client.cancel(job["id"]))
                with recorder.lock:
                    ids.append(job["id"])
                    if cancelled is not None:
                        statuses[cancelled["status"]] = statuses.get(cancelled["status"], 0) + 1

            run_phase(url, key, args.concurrency, WARMUP_PAIRS, submit_and_cancel)
            statuses.clear()
            pair_seconds, pairs = run_phase(url, key, args.concurrency, args.jobs, submit_and_cancel)
            poll_seconds, polls = run_phase(
                url,
                key,
                args.concurrency,
                args.polls,
                lambda c, n, r: r.timed("status", lambda: c.get(ids[n % len(ids)])),
            )
    return {
        "database": "postgresql" if mode == "distributed" else "sqlite",
        "broker": "redis" if mode == "distributed" else None,
        "storage": "local",
        "submit_cancel": {
            "pairs": args.jobs,
            "seconds": pair_seconds,
            "pairs_per_second": args.jobs / pair_seconds,
            "errors": len(pairs.errors),
            "error_examples": pairs.errors[:5],
            "latency_ms": {kind: percentiles_ms(pairs.latencies.get(kind, [])) for kind in ("submit", "cancel")},
            # A queued job is cancelled at once: anything else would mean a worker took it.
            "statuses_after_cancel": statuses,
            "not_cancelled": sum(count for status, count in statuses.items() if status != "cancelled"),
        },
        "status": {
            "polls": args.polls,
            "seconds": poll_seconds,
            "polls_per_second": args.polls / poll_seconds,
            "errors": len(polls.errors),
            "error_examples": polls.errors[:5],
            "latency_ms": percentiles_ms(polls.latencies.get("status", [])),
        },
    }


class EventStream:
    """One `?stream=true` response read from a raw socket (HTTP/1.1, chunked): when each event id arrived."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.status: int | None = None
        self.arrivals: list[tuple[int, float]] = []
        self.started = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None

    async def run(self, port: int, key: str) -> None:
        reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.writer.write(
            f"GET /v1/jobs/{self.job_id}/events?stream=true HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {key}\r\nAccept: text/event-stream\r\n\r\n".encode()
        )
        self.status = int((await reader.readline()).split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):  # the headers
            pass
        if self.status != 200:
            self.started.set()
            return
        pending = b""
        while size := int((await reader.readline()).strip() or b"0", 16):
            pending += (await reader.readexactly(size + 2))[:-2]
            *blocks, pending = SSE_BLOCK_END.split(pending)
            for block in blocks:
                for line in block.splitlines():
                    if line.startswith(b"id:"):
                        self.arrivals.append((int(line[3:]), time.monotonic()))
                        self.started.set()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


SSE_BLOCK_END = re.compile(rb"\r\n\r\n|\n\n")
# Stream requests in flight at once while they are opened (each is a request like any other first).
OPENING_AT_ONCE = 50


def start_running(database_url: str, job_ids: list[str]) -> dict[str, int]:
    """Claims the jobs as a worker would: a running job's cancel request only flags it, so it writes an event
    each time and the job, and its streams, go on. Returns each job's last event id so far."""
    last = {}
    with session_scope(database_url) as session:
        for job_id in job_ids:
            assert job_queue.claim_job(session, job_id, "load-bench") is not None
        session.flush()
        for job_id in job_ids:
            events, _ = jobs.list_events(session, job_id, limit=100, after=None)
            last[job_id] = events[-1].id
    return last


async def hold_streams(
    port: int, key: str, job_ids: list[str], count: int
) -> tuple[list[EventStream], list[asyncio.Task[None]], float, int | None]:
    """`count` streams spread over the jobs, each open with its first events in; then the status of one more."""
    streams = [EventStream(job_ids[i % len(job_ids)]) for i in range(count)]
    opening = asyncio.Semaphore(OPENING_AT_ONCE)

    async def open_one(stream: EventStream) -> None:
        async with opening:
            task = asyncio.create_task(stream.run(port, key))
            tasks.append(task)
            await asyncio.wait([task, asyncio.create_task(stream.started.wait())], return_when=asyncio.FIRST_COMPLETED)

    tasks: list[asyncio.Task[None]] = []
    start = time.perf_counter()
    await asyncio.gather(*(open_one(stream) for stream in streams))
    open_seconds = time.perf_counter() - start
    extra = EventStream(job_ids[0])
    await asyncio.wait_for(extra.run(port, key), 30)
    extra.close()
    return streams, tasks, open_seconds, extra.status


def measure_streams(args: argparse.Namespace, url: str, key: str, database_url: str) -> dict[str, Any]:
    port = int(url.rsplit(":", 1)[1])
    with CaspClient(url, api_key=key, retries=0) as client:
        job_ids = [client.submit(JOB)["id"] for _ in range(args.stream_jobs)]
    initial_last = start_running(database_url, job_ids)
    sent: dict[tuple[str, int], float] = {}
    polls = Recorder()
    cancels = Recorder()
    statuses: dict[int, int] = {}

    def count_status(status: int) -> None:
        with polls.lock:
            statuses[status] = statuses.get(status, 0) + 1

    def write_events() -> None:
        """Round by round, a cancel request on every job: one event each, on 2 threads."""

        def one(client: CaspClient, n: int, _: Recorder) -> None:
            job_id, round_ = job_ids[n % len(job_ids)], n // len(job_ids)
            with cancels.lock:
                sent[(job_id, round_)] = time.monotonic()
            response = cancels.timed("cancel", lambda: client.http.post(f"/v1/jobs/{job_id}/cancel"))
            if response is not None:
                count_status(response.status_code)

        per_round = len(job_ids)
        for round_ in range(args.stream_rounds):
            run_phase(url, key, 2, per_round, lambda c, n, r, first=round_ * per_round: one(c, n + first, r))

    def poll_until(done: threading.Event) -> None:
        def one(client: CaspClient, n: int, recorder: Recorder) -> None:
            if done.is_set():
                return
            response = recorder.timed("status", lambda: client.http.get(f"/v1/jobs/{job_ids[n % len(job_ids)]}"))
            if response is not None:
                count_status(response.status_code)

        while not done.is_set():
            _, recorder = run_phase(url, key, args.concurrency, args.concurrency * 10, one)
            with polls.lock:
                polls.errors += recorder.errors
                for kind, values in recorder.latencies.items():
                    polls.latencies.setdefault(kind, []).extend(values)

    async def run() -> dict[str, Any]:
        streams, tasks, open_seconds, extra_status = await hold_streams(port, key, job_ids, args.streams)
        opened = [stream for stream in streams if stream.status == 200]

        def written(stream: EventStream) -> list[float]:
            """Arrival times of the events written in the rounds, in order."""
            return [at for event_id, at in stream.arrivals if event_id > initial_last[stream.job_id]]

        done = threading.Event()
        poller = asyncio.create_task(asyncio.to_thread(poll_until, done))
        start = time.perf_counter()
        await asyncio.to_thread(write_events)
        # Whatever is still on its way has a second more than the goal to arrive.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(len(written(s)) < args.stream_rounds for s in opened):
            await asyncio.sleep(0.05)
        event_seconds = time.perf_counter() - start
        done.set()
        await poller
        for stream in streams:
            stream.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        delays = [
            arrived - sent[(stream.job_id, round_)]
            for stream in opened
            for round_, arrived in enumerate(written(stream))
            if (stream.job_id, round_) in sent
        ]
        for stream in streams:
            if stream.status is not None:
                count_status(stream.status)
        return {
            "streams": args.streams,
            "jobs": len(job_ids),
            "rounds": args.stream_rounds,
            "opened": len(opened),
            "open_seconds": open_seconds,
            "over_cap_status": extra_status,
            "events": len(sent),
            "deliveries_expected": len(opened) * args.stream_rounds,
            "delivered": len(delays),
            "event_seconds": event_seconds,
            "delivery_ms": percentiles_ms(delays),
            "delivered_within_1s": sum(delay <= 1.0 for delay in delays),
            "cancel_latency_ms": percentiles_ms(cancels.latencies.get("cancel", [])),
            "status": {
                "polls": len(polls.latencies.get("status", [])),
                "latency_ms": percentiles_ms(polls.latencies.get("status", [])),
            },
            "http_statuses": {str(code): n for code, n in sorted(statuses.items())},
            "server_errors": sum(n for code, n in statuses.items() if code >= 500),
            "errors": len(polls.errors) + len(cancels.errors),
            "error_examples": (polls.errors + cancels.errors)[:5],
        }

    return asyncio.run(run())


def stream_goals(result: dict[str, Any]) -> dict[str, bool]:
    """The goals of issue 29: every event on every stream within 1 s, status p99 < 250 ms, no 5xx, and the
    stream over the key's cap refused."""
    return {
        "every_event_within_1s": result["delivered_within_1s"] == result["deliveries_expected"] > 0,
        "status_p99_below_250ms": result["status"]["latency_ms"]["p99"] < 250,
        "no_5xx": result["server_errors"] == 0,
        "over_cap_refused": result["over_cap_status"] == 429,
    }


def streams_mode(mode: str, args: argparse.Namespace, database_url: str | None, broker_url: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"casp-streams-{mode}-") as tmp:
        home = Path(tmp)
        values = service_settings(mode, home, database_url, broker_url, max_streams=args.streams)
        with casp_serve(values, home) as (url, key):
            result = measure_streams(args, url, key, Settings(**values).database)  # type: ignore[arg-type]
    return result | {"goals": stream_goals(result)}


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    if mode == "embedded":
        return measure_mode(mode, args, None, None) | {"event_streams": streams_mode(mode, args, None, None)}
    with postgres_database(args.pg_admin_url) as database_url, empty_redis(args.redis_url) as broker_url:
        result = measure_mode(mode, args, database_url, broker_url)
    with postgres_database(args.pg_admin_url) as database_url, empty_redis(args.redis_url) as broker_url:
        return result | {"event_streams": streams_mode(mode, args, database_url, broker_url)}


def render_markdown(payload: dict[str, Any]) -> str:
    machine, settings = payload["machine"], payload["settings"]
    lines = [
        "# Load: the jobs API under submissions, cancels and status polls",
        "",
        f"{machine_line(machine)}; load average {machine['loadavg_start'][0]:.1f} at the start, "
        f"{machine['loadavg_end'][0]:.1f} at the end (1 minute).",
        "",
        " ".join(filter(None, [concurrency_note(machine), settings["note"]])),
        "",
        f"`casp serve` (one process, no worker) and {settings['concurrency']} client threads on the same machine, "
        f"over loopback; {settings['jobs']} submit+cancel pairs, then {settings['polls']} status polls per mode; "
        "API-key auth; latency as the client sees it.",
        "",
        "| mode | store | submit+cancel pairs/s | submit p50 / p99 ms | cancel p50 / p99 ms | status polls/s "
        "| status p50 / p99 ms | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, result in payload["modes"].items():
        pairs, polls = result["submit_cancel"], result["status"]
        submit, cancel, status = pairs["latency_ms"]["submit"], pairs["latency_ms"]["cancel"], polls["latency_ms"]
        store = result["database"] + (f" + {result['broker']}" if result["broker"] else "")
        lines.append(
            f"| {mode} | {store} | {pairs['pairs_per_second']:.1f} | {submit['p50']:.1f} / {submit['p99']:.1f} "
            f"| {cancel['p50']:.1f} / {cancel['p99']:.1f} | {polls['polls_per_second']:.1f} "
            f"| {status['p50']:.1f} / {status['p99']:.1f} | {pairs['errors'] + polls['errors']} |"
        )
    lines += [
        "",
        "## Event streams",
        "",
        f"A fresh `casp serve` per mode; {settings['streams']} Server-Sent Event streams held open at once by one key"
        f" (CASP_MAX_STREAMS_PER_KEY set to that) over {settings['stream_jobs']} running jobs, read by one asyncio"
        f" loop in the bench process; {settings['stream_rounds']} rounds of a cancel request on every job (an event"
        f" each, from 2 client threads) while {settings['concurrency']} threads poll the jobs' status. Delivery: from"
        " the moment the event's request was sent to its arrival on a stream (so it includes that request's own"
        " time).",
        "",
        "| mode | streams open (s to open) | deliveries | delivery p50 / p99 / max ms | within 1 s "
        "| cancel request p50 / p99 / max ms | status polls | status p50 / p99 ms | 5xx | stream over the cap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode, result in payload["modes"].items():
        streams = result["event_streams"]
        delivery, status, cancel = streams["delivery_ms"], streams["status"]["latency_ms"], streams["cancel_latency_ms"]
        lines.append(
            f"| {mode} | {streams['opened']} ({streams['open_seconds']:.1f}) "
            f"| {streams['delivered']} of {streams['deliveries_expected']} "
            f"| {delivery['p50']:.0f} / {delivery['p99']:.0f} / {delivery['max']:.0f} "
            f"| {streams['delivered_within_1s']} "
            f"| {cancel['p50']:.0f} / {cancel['p99']:.0f} / {cancel['max']:.0f} | {streams['status']['polls']} "
            f"| {status['p50']:.1f} / {status['p99']:.1f} | {streams['server_errors']} "
            f"| {streams['over_cap_status']} |"
        )
    lines += [
        "",
        "Goals (issue 29): "
        + "; ".join(
            f"{mode}: "
            + ", ".join(
                f"{goal} {'met' if met else 'NOT met'}" for goal, met in result["event_streams"]["goals"].items()
            )
            for mode, result in payload["modes"].items()
        )
        + ".",
    ]
    lines += ["", "Rerun: `PYTHONPATH=. python -m bench.load` (see bench/README.md).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    machine = machine_info()
    start = time.perf_counter()
    modes = {}
    for mode in args.modes:
        modes[mode] = run_mode(mode, args)
        result = modes[mode]
        print(
            f"{mode}: {result['submit_cancel']['pairs_per_second']:.1f} submit+cancel pairs/s, "
            f"{result['status']['polls_per_second']:.1f} status polls/s, "
            f"{result['submit_cancel']['errors'] + result['status']['errors']} errors; "
            f"{result['event_streams']['opened']} streams, {result['event_streams']['delivered']} of "
            f"{result['event_streams']['deliveries_expected']} deliveries, "
            f"p99 {result['event_streams']['delivery_ms']['p99']:.0f} ms, goals {result['event_streams']['goals']}"
        )
    payload = {
        "modes": modes,
        "machine": finish_machine_info(machine),
        "settings": {
            "jobs": args.jobs,
            "polls": args.polls,
            "concurrency": args.concurrency,
            "streams": args.streams,
            "stream_jobs": args.stream_jobs,
            "stream_rounds": args.stream_rounds,
            "warmup_pairs": WARMUP_PAIRS,
            "niceness": os.nice(0),  # the bench and its server ran at this priority
            "note": args.note,
            "total_seconds": time.perf_counter() - start,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "load.json", payload)
    (args.out / "load.md").write_text(render_markdown(payload))
    errors = sum(
        m["submit_cancel"]["errors"]
        + m["status"]["errors"]
        + m["event_streams"]["errors"]
        + m["event_streams"]["server_errors"]
        + m["event_streams"]["deliveries_expected"]
        - m["event_streams"]["delivered"]
        for m in modes.values()
    )
    not_cancelled = sum(m["submit_cancel"]["not_cancelled"] for m in modes.values())
    if errors or not_cancelled or not all_finite(payload):
        raise SystemExit(
            f"load bench: {errors} errors (5xx and undelivered events included), {not_cancelled} jobs not"
            " cancelled or a non-finite number"
        )
    return payload


if __name__ == "__main__":
    main()
