"""The `casp` command: the library's commands (casp_core.cli: prune, eval) and the service's: serve, demo, keys
(create, revoke, list, set-hub-token), webhooks secret, worker, and submit, status, wait, download, models (upload,
list, delete) through the client. `python -m casp_cli.main ...` runs it.
"""

import argparse
import getpass
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from casp_cli.client import DEFAULT_RETRIES, GGUF_SUFFIX, ArtifactError, CaspAPIError, CaspClient
from casp_core.artifacts.caches import cache_max_bytes
from casp_core.cli.arguments import non_negative_int, positive_int
from casp_core.cli.main import main as casp_main
from casp_core.cli.setting_flags import add_setting_flags, settings_from_args
from casp_core.errors import InvalidConfig
from service.logs import configure_logging, without_progress_bars
from service.settings import AUTO, DEVICES, Settings, load_settings, local_devices, resolve_device

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "demo" / "stories260K"
DEMO_DATASETS = REPO / "demo" / "datasets"
DEFAULT_URL = "http://127.0.0.1:8000"


# --- running the service -----------------------------------------------------------------------------


def prepare(settings: Settings) -> None:
    """Creates CASP_HOME (the embedded database lives there) and migrates the database to head."""
    from service.migrate import upgrade

    settings.home.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database)


def serve(settings: Settings, sock: socket.socket, log_level: str = "info") -> None:
    """Migrates the database, then serves the API (and, without a broker, the in-process workers)."""
    without_progress_bars(settings.log_format)
    import uvicorn

    from casp_cli.app import service_app

    configure_logging(settings.log_format, log_level)
    prepare(settings)
    # JSON: uvicorn's own loggers (its access log too) propagate to the root logger's JSON handler; text:
    # uvicorn's usual coloured lines.
    log_config = None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG
    config = uvicorn.Config(service_app(settings), log_level=log_level, log_config=log_config)
    uvicorn.Server(config).run(sockets=[sock])


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    serve(load_settings(), bind(args.host, args.port), args.log_level)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    settings = load_settings()
    without_progress_bars(settings.log_format)
    cache_max_bytes()  # casp_core reads CASP_CACHE_MAX_BYTES at each GGUF job: a wrong one stops the start instead
    device = resolve_device(args.device or settings.default_device)
    if device not in local_devices():
        raise SystemExit(f"casp worker: no {device} device on this machine (torch sees: {', '.join(local_devices())})")
    # The worker's own device is the default its jobs for any device (queue casp-auto) run on.
    os.environ["CASP_DEFAULT_DEVICE"] = device
    from service.dispatch import queue_for
    from worker.tasks import app

    queues = f"{queue_for(device)},{queue_for(AUTO)}"
    # JSON logs (worker.tasks sets them up): without Celery's start banner, which is plain text.
    quiet = ["--quiet"] if settings.log_format == "json" else []
    app.worker_main([*quiet, "worker", "-Q", queues, "-n", f"casp-{device}@%h", "--loglevel", args.log_level])
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    from service import api_keys
    from service.db import session_scope

    settings = load_settings()
    prepare(settings)
    with session_scope(settings.database) as session:
        row, key = api_keys.create_api_key(
            session,
            args.name,
            max_active_jobs=args.max_active_jobs,
            max_submissions_per_minute=args.max_submissions_per_minute,
        )
    print(f"key id {row.id} ({args.name}); the key is shown only now:", file=sys.stderr)
    print(key)
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from service import api_keys
    from service.db import session_scope

    settings = load_settings()
    prepare(settings)
    with session_scope(settings.database) as session:
        row = api_keys.revoke_api_key(session, args.key_id)
        if row is None:
            print(f"casp: error: not_found: no API key with id {args.key_id} (see casp keys list)", file=sys.stderr)
            return 1
        print(f"revoked key {row.id} ({row.name}); its jobs stay", file=sys.stderr)
    return 0


def cmd_keys_set_hub_token(args: argparse.Namespace) -> int:
    from service import api_keys
    from service.db import session_scope
    from service.security import encrypt_hub_token

    settings = load_settings()
    prepare(settings)
    token = None
    if not args.clear:
        # Read from the terminal without echo, or from a pipe: never from the command line, where `ps` and the
        # shell's history would keep it.
        token = (getpass.getpass("hub token: ") if sys.stdin.isatty() else sys.stdin.readline()).strip()
        if not token:
            print("casp: error: invalid_request: no token given on stdin (use --clear to remove one)", file=sys.stderr)
            return 2
    encrypted = encrypt_hub_token(settings.verification_keys, token) if token else None
    with session_scope(settings.database) as session:
        row = api_keys.set_hub_token(session, args.key_id, encrypted)
        if row is None:
            print(f"casp: error: not_found: no API key with id {args.key_id} (see casp keys list)", file=sys.stderr)
            return 1
        done = "removed" if args.clear else "stored encrypted; used for this key's jobs only"
        print(f"hub token of key {row.id} ({row.name}) {done}", file=sys.stderr)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    from service import api_keys
    from service.db import session_scope

    settings = load_settings()
    prepare(settings)
    with session_scope(settings.database) as session:
        for row in api_keys.list_api_keys(session):
            state = "revoked" if api_keys.is_revoked(row) else "active"
            hub = "hub-token" if row.hub_token else "-"
            print(f"{row.id}  {state:<7}  {row.created_at:%Y-%m-%d %H:%M}  {hub:<9}  {row.name}")
    return 0


def cmd_webhooks_secret(args: argparse.Namespace) -> int:
    from service.webhooks import new_secret

    print(new_secret())
    return 0


DEMO_PERPLEXITY_NOTE = (
    "note: the pruned model scores below the dense one here because the demo model was trained on children's "
    "stories (TinyStories), not on WikiText-2, and pruning compensates the kept units by least squares on the "
    "calibration text, WikiText-2: the pruned model is fitted to a text the dense one never saw, so this figure says "
    "little about the model's quality on its own domain."
)


def demo_request(model: Path) -> dict[str, Any]:
    """Settings small enough for a laptop CPU in seconds, on the bundled model and data sets."""
    return {
        "model": str(model),
        "ratio": 0.3,
        "device": "cpu",
        "calibration": {"dataset": "wikitext2:validation", "n_samples": 16, "seq_len": 128},
        # The first 32 windows of the test set: the whole set takes minutes on a CPU.
        "evaluation": {"perplexity": ["wikitext2"], "seq_len": 128, "limit": 32},
        "metadata": {"source": "casp demo"},
    }


def cmd_demo(args: argparse.Namespace) -> int:
    home = Path(args.home).resolve()
    model = Path(args.model).resolve()
    # Explicit values win over CASP_* variables: the demo is always the self-contained embedded mode.
    settings = Settings(
        home=home,
        database_url=None,
        broker_url=None,
        storage_url=None,
        auth="none",
        allowed_model_roots=[model.parent],
        datasets_dir=Path(args.datasets_dir).resolve(),
        default_device="cpu",
        embedded_workers=1,
    )
    sock = bind("127.0.0.1", args.port)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = threading.Thread(target=serve, args=(settings, sock, "warning"), daemon=True)
    server.start()
    print(f"casp service (embedded mode, data in {home}) at {url}; API docs at {url}/docs")
    print(f"console: {url}/console (the jobs, their progress and reports, a form to submit one)")
    with CaspClient(url) as client:
        wait_until_up(client, server)
        job = client.submit(demo_request(model))
        print(f"submitted job {job['id']}: prune {model.name} by {job['settings']['ratio']:.0%}")
        print(f"follow it at {url}/console/jobs/{job['id']}")
        job = client.wait(job["id"], timeout=args.timeout, on_update=progress_printer())
        if job["status"] != "succeeded":
            print(f"job {job['status']}: {job['error']}", file=sys.stderr)
            return 1
        out = home / "demo-output" / job["id"]
        client.download(job["id"], out)
    result = job["result"]
    counted = result["params"].get("counted", "parameters")
    print(f"{counted}: {result['params']['dense']:,} -> {result['params']['pruned']:,}", end="")
    print(f" (achieved ratio {result['achieved_ratio']:.3f})")
    for dataset, ppl in result["perplexity"].items():
        split = f" ({ppl['split']} split)" if ppl.get("split") else ""
        print(f"perplexity {dataset}: dense {ppl['dense']:.2f}, pruned {ppl['pruned']:.2f}{split}")
    if any(ppl["pruned"] < ppl["dense"] for ppl in result["perplexity"].values()):
        print(DEMO_PERPLEXITY_NOTE)
    print(f"checkpoint: {out}")
    print(f"report:     {out / 'report.md'}")
    print(f"to browse it in the console again: CASP_HOME={home} CASP_AUTH=none casp serve, then {DEFAULT_URL}/console")
    return 0


def wait_until_up(client: CaspClient, server: threading.Thread, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.is_alive():
        try:
            client.http.get("/healthz").raise_for_status()
            return
        except Exception:
            time.sleep(0.2)
    raise RuntimeError("the service did not start")


def progress_printer() -> Callable[[dict[str, Any]], None]:
    last: list[tuple[str, str | None, int]] = []

    def show(job: dict[str, Any]) -> None:
        state = (job["status"], job["stage"], int(job["progress"]))
        if not last or state != last[-1]:
            last.append(state)
            print(f"  {job['status']:<9} {job['stage'] or '':<13} {job['progress']:5.1f}%", file=sys.stderr)

    return show


# --- talking to a running service --------------------------------------------------------------------


def client_of(args: argparse.Namespace) -> CaspClient:
    # The key is read here, not as the option's default, so that `--help` never prints it.
    return CaspClient(args.url, api_key=args.api_key or os.environ.get("CASP_API_KEY"), retries=args.retries)


def given(**values: Any) -> dict[str, Any]:
    """The options that were set: argparse leaves the others None, and the server fills in its defaults."""
    return {name: value for name, value in values.items() if value is not None}


def submit_request(args: argparse.Namespace) -> dict[str, Any]:
    if args.json:
        try:
            return json.loads(Path(args.json).read_text())
        except (OSError, ValueError) as error:
            raise InvalidConfig(f"--json {args.json}: {error}") from error
    chosen = settings_from_args(args)
    if args.model is None or ("ratio" not in chosen and "target" not in chosen):
        raise SystemExit(
            "casp submit: needs --model and --ratio (or a target: --target-bytes, --target-params or "
            "--max-perplexity-increase), or --json"
        )
    return {
        "model": args.model,
        **chosen,
        **given(revision=args.revision, device=args.device),
        "metadata": dict(item.split("=", 1) for item in args.metadata),
    }


def cmd_submit(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        job = client.submit(submit_request(args), idempotency_key=args.idempotency_key)
        if args.wait:
            job = client.wait(job["id"], on_update=progress_printer())
    print(json.dumps(job, indent=2))
    return 0 if not args.wait or job["status"] == "succeeded" else 1


def cmd_status(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        print(json.dumps(client.get(args.job_id), indent=2))
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        try:
            job = client.wait(args.job_id, timeout=args.timeout, on_update=progress_printer())
        except TimeoutError as error:
            print(f"casp: error: timeout: {error}", file=sys.stderr)
            return 1
    print(json.dumps(job, indent=2))
    return 0 if job["status"] == "succeeded" else 1


def cmd_download(args: argparse.Namespace) -> int:
    out = Path(args.out or args.job_id)
    with client_of(args) as client:
        paths = client.download(args.job_id, out)
    print(f"{len(paths)} files in {out.resolve()}")
    return 0


def cmd_models_upload(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    path = Path(args.path)
    if not (path.is_dir() or (path.is_file() and path.name.lower().endswith(GGUF_SUFFIX))):
        print(f"casp: error: invalid_request: {args.path} is not a model folder or a .gguf file", file=sys.stderr)
        return 2
    with client_of(args) as client, tqdm(unit="B", unit_scale=True, desc="uploading", file=sys.stderr) as bar:

        def show(sent: int, total: int) -> None:
            bar.total = total
            bar.update(sent - bar.n)

        uploaded = client.upload_model(
            path, args.name, args.retention_seconds, on_progress=show, presigned=args.presigned
        )
    print(json.dumps(uploaded, indent=2))
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        print(json.dumps(client.models(), indent=2))
    return 0


def cmd_models_delete(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        client.delete_model(args.model_id)
    print(f"deleted uploaded model {args.model_id}", file=sys.stderr)
    return 0


# --- wiring ------------------------------------------------------------------------------------------


def _client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("CASP_URL", DEFAULT_URL), help="service URL (CASP_URL)")
    parser.add_argument("--api-key", help="API key (default: CASP_API_KEY)")
    parser.add_argument(
        "--retries",
        type=non_negative_int,
        default=DEFAULT_RETRIES,
        help="how many times a request is sent again after a connection error or a 503, with backoff",
    )


def register(subparsers: Any) -> None:
    """Adds the service commands to an argparse sub-parser collection."""
    p = subparsers.add_parser("serve", help="run the jobs API (and, without CASP_BROKER_URL, its workers)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    p.set_defaults(run=cmd_serve)

    p = subparsers.add_parser("demo", help="start the embedded service and prune the bundled demo model")
    p.add_argument("--home", default="casp-home", help="where the demo keeps its database and artifacts")
    p.add_argument("--port", type=int, default=0, help="0: any free port")
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--datasets-dir", default=str(DEMO_DATASETS))
    p.add_argument("--timeout", type=float, default=1800.0)
    p.set_defaults(run=cmd_demo)

    p = subparsers.add_parser("worker", help="run a Celery worker (one job at a time) for one device queue")
    p.add_argument("--device", choices=DEVICES, help="default: CASP_DEFAULT_DEVICE (auto: cuda if present, else cpu)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(run=cmd_worker)

    keys = subparsers.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("create", help="create an API key and print it")
    p.add_argument("--name", required=True)
    p.add_argument(
        "--max-active-jobs", type=positive_int, help="jobs queued or running at once; default: CASP_MAX_ACTIVE_JOBS"
    )
    p.add_argument(
        "--max-submissions-per-minute",
        type=positive_int,
        help="jobs submitted in any 60 s; default: CASP_MAX_SUBMISSIONS_PER_MINUTE",
    )
    p.set_defaults(run=cmd_keys_create)
    p = keys.add_parser("revoke", help="revoke an API key at once (its jobs and artifacts stay)")
    p.add_argument("key_id", help="the id `casp keys create` printed (or `casp keys list` shows)")
    p.set_defaults(run=cmd_keys_revoke)
    p = keys.add_parser(
        "set-hub-token",
        help="give a key a Hugging Face token for private repositories (read from stdin, stored encrypted)",
    )
    p.add_argument("key_id", help="the id `casp keys create` printed (or `casp keys list` shows)")
    p.add_argument("--clear", action="store_true", help="remove the key's hub token")
    p.set_defaults(run=cmd_keys_set_hub_token)
    p = keys.add_parser("list", help="list API keys: id, active or revoked, created, whether it has a hub token, name")
    p.set_defaults(run=cmd_keys_list)

    webhooks = subparsers.add_parser("webhooks", help="webhooks").add_subparsers(dest="webhooks_command", required=True)
    p = webhooks.add_parser(
        "secret",
        help="print a new random CASP_WEBHOOK_SECRET in the Standard Webhooks form (whsec_...), for casp and receivers",
    )
    p.set_defaults(run=cmd_webhooks_secret)

    p = subparsers.add_parser(
        "submit", help="submit a pruning job", description="Options left out take the server's defaults."
    )
    _client_options(p)
    p.add_argument("--json", help="a file with the whole request body (the other options are ignored)")
    p.add_argument(
        "--model",
        help="Hugging Face id, a path under the server's allowed roots, s3://bucket/prefix or casp://models/<id>",
    )
    p.add_argument("--revision")
    p.add_argument("--device", choices=DEVICES)
    add_setting_flags(p)
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--idempotency-key")
    p.add_argument("--wait", action="store_true", help="wait until the job has finished")
    p.set_defaults(run=cmd_submit)

    for name, func, helptext in (("status", cmd_status, "show a job"), ("wait", cmd_wait, "wait for a job")):
        p = subparsers.add_parser(name, help=helptext)
        _client_options(p)
        p.add_argument("job_id")
        if name == "wait":
            p.add_argument("--timeout", type=float)
        p.set_defaults(run=func)

    models = subparsers.add_parser("models", help="models uploaded to the service, for jobs to prune")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    p = models_commands.add_parser(
        "upload",
        help="upload a model folder or a GGUF file (checked by the service); jobs name it as the `model` it prints",
    )
    _client_options(p)
    p.add_argument("path", help="the model's folder (config.json, the tokenizer, *.safetensors), or a .gguf file")
    p.add_argument("--name", help="the model's name (its pruned model card's); default: the folder's or file's name")
    p.add_argument("--retention-seconds", type=positive_int, help="how long it is kept; default: the server's")
    p.add_argument(
        "--presigned",
        action="store_true",
        help="upload straight into the service's bucket through a presigned URL (servers with S3 storage)",
    )
    p.set_defaults(run=cmd_models_upload)
    p = models_commands.add_parser("list", help="the models this key uploaded")
    _client_options(p)
    p.set_defaults(run=cmd_models_list)
    p = models_commands.add_parser("delete", help="delete an uploaded model now")
    _client_options(p)
    p.add_argument("model_id")
    p.set_defaults(run=cmd_models_delete)

    p = subparsers.add_parser("download", help="download a job's artifacts, checking each sha256")
    _client_options(p)
    p.add_argument("job_id")
    p.add_argument("--out", help="target folder (default: the job id)")
    p.set_defaults(run=cmd_download)


def main(argv: list[str] | None = None) -> int:
    """The whole `casp` command: the library's commands (prune, eval) and the service's. The service's errors
    get one line too: a refused request exits 2 when it was the caller's to fix (4xx), 1 otherwise."""
    try:
        return casp_main(argv, extensions=[register])
    except CaspAPIError as error:
        # The service's own error code, as casp_core's errors print theirs; the HTTP status where it gave none.
        print(f"casp: error: {error.code or f'HTTP {error.status_code}'}: {error.message}", file=sys.stderr)
        return 2 if 400 <= error.status_code < 500 else 1
    except ArtifactError as error:
        print(f"casp: error: {error.code}: {error.message}", file=sys.stderr)
        return 1
    except httpx.TransportError as error:
        # The transport's note says how many attempts were made, and over how long.
        tried = "; ".join(getattr(error, "__notes__", []))
        print(
            f"casp: error: service_unreachable: {error.request.method} {error.request.url}: "
            f"{type(error).__name__}: {error or 'no detail'}" + (f" ({tried})" if tried else ""),
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
