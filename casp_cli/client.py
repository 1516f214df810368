"""A small Python client of the jobs API, for internal tooling and the `casp submit|status|wait|download`
commands."""

import contextlib
import hashlib
import json
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx
import tenacity

FINISHED = ("succeeded", "failed", "cancelled")
DEFAULT_RETRIES = 3
CONNECT_TIMEOUT = 5.0  # a host that drops packets costs at most this per attempt, not the whole read timeout
# A stream refused because the key holds as many as the server allows (429): the events are polled this long,
# a page every POLL_SECONDS, before a stream is asked for again (the server's Retry-After).
POLL_INSTEAD_SECONDS = 10.0
POLL_SECONDS = 1.0
# Without a client timeout, a stream without a byte (the server sends a keep-alive every 15 s) is given up after this.
STREAM_READ_SECONDS = 60.0
RETRIED_STATUS = 503  # the service is up but cannot serve now (its database or queue is down): ask again later
# A request that may have reached the server is sent again only if a second copy does nothing more than the first.
REPEATABLE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
# These errors mean the request never left this machine, so any request may be sent again.
NOT_SENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


def _repeatable(request: httpx.Request) -> bool:
    return request.method in REPEATABLE_METHODS or "Idempotency-Key" in request.headers


def _discard_answer(state: tenacity.RetryCallState) -> None:
    """Before waiting for the next attempt: a 503's connection goes back to the pool."""
    if state.outcome is not None and not state.outcome.failed:
        state.outcome.result().close()


class RetryingTransport(httpx.BaseTransport):
    """Sends a request again after a connection error or a 503, waiting `backoff` seconds doubled each time
    with as much jitter (tenacity), or what a 503's Retry-After asks, never more than `max_backoff`; after
    `retries` more attempts the last answer or error goes back as is, the error with a note of the attempts.
    Bounded on purpose: a service that is down fails a command in seconds."""

    def __init__(
        self,
        retries: int = DEFAULT_RETRIES,
        backoff: float = 0.5,
        max_backoff: float = 4.0,
        inner: httpx.BaseTransport | None = None,
    ) -> None:
        self.inner = inner or httpx.HTTPTransport()
        self.max_backoff = max_backoff
        self._exponential = tenacity.wait_exponential(multiplier=backoff, max=max_backoff) + tenacity.wait_random(
            0, backoff
        )
        self._retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(retries + 1),
            wait=self._wait,
            before_sleep=_discard_answer,
            # Past the last attempt: its answer (the caller sees the 503) or its error, unchanged.
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )

    def _wait(self, state: tenacity.RetryCallState) -> float:
        if state.outcome is not None and not state.outcome.failed:
            retry_after = state.outcome.result().headers.get("Retry-After", "")
            if retry_after.isdigit():  # seconds; the rarer HTTP-date form falls back to the backoff
                return min(float(retry_after), self.max_backoff)
        return self._exponential(state)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        def worth_retrying(error: BaseException) -> bool:
            return isinstance(error, NOT_SENT_ERRORS) or (
                isinstance(error, httpx.TransportError) and _repeatable(request)
            )

        # A copy per request: its statistics count this request's attempts, whichever thread sends it.
        retrying = self._retrying.copy(
            retry=tenacity.retry_if_exception(worth_retrying)
            | tenacity.retry_if_result(lambda response: response.status_code == RETRIED_STATUS)
        )
        try:
            return retrying(self.inner.handle_request, request)
        except httpx.TransportError as error:
            attempts = retrying.statistics.get("attempt_number", 1)
            seconds = retrying.statistics.get("delay_since_first_attempt", 0.0)
            error.add_note(f"{attempts} attempt{'s' if attempts > 1 else ''} in {seconds:.1f} s")
            raise

    def close(self) -> None:
        self.inner.close()


class CaspAPIError(Exception):
    """An error answer: `code`, `message` and `param` as in the service's `{"error": {...}}` body."""

    def __init__(self, status_code: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.code = code
        self.param = param


class ArtifactError(Exception):
    """A downloaded artifact that cannot be kept: `code` says why (sha256_mismatch, unsafe_name)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# A presigned PUT's body is streamed in chunks of this size, each counted as it goes.
PUT_CHUNK_BYTES = 1 << 20
# A file of this suffix (any case) is uploaded as it is, a GGUF file; a folder is packed as a tar. (casp_core's
# is_gguf_reference, which this client does not import: it would load torch.)
GGUF_SUFFIX = ".gguf"


class ReadProgress:
    """A file whose reads are counted (httpx reads a multipart file in chunks): `on_read` gets the bytes read."""

    def __init__(self, file: IO[bytes], on_read: Callable[[int], None]) -> None:
        self.file = file
        self.on_read = on_read

    def read(self, size: int = -1) -> bytes:
        chunk = self.file.read(size)
        self.on_read(len(chunk))
        return chunk

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.file.seek(offset, whence)

    def tell(self) -> int:
        return self.file.tell()

    def fileno(self) -> int:
        return self.file.fileno()


class CaspClient:
    """Every request goes through a RetryingTransport: `retries` more attempts after a connection error or a 503,
    the first after about `backoff` seconds."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 30.0,
        retries: int = DEFAULT_RETRIES,
        backoff: float = 0.5,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.retries, self.backoff = retries, backoff
        self.http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT)),
            transport=self._transport(),
        )

    def _transport(self) -> RetryingTransport:
        return RetryingTransport(self.retries, self.backoff)

    def __enter__(self) -> "CaspClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if not response.is_error:
            return
        response.read()
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):  # not the service's answer (a proxy's, say)
            raise CaspAPIError(response.status_code, response.text) from None
        raise CaspAPIError(response.status_code, error["message"], error["code"], error["param"])

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        self._raise_for(response)
        return response.json() if response.content else None

    def submit(self, request: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/v1/jobs", json=request, headers=headers)

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def jobs(self, status: str | None = None, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        params = {k: v for k, v in {"status": status, "limit": limit, "after": after}.items() if v is not None}
        return self._call("GET", "/v1/jobs", params=params)

    def events(self, job_id: str, after: int | None = None, limit: int = 100) -> dict[str, Any]:
        params = {"limit": limit, **({"after": after} if after is not None else {})}
        return self._call("GET", f"/v1/jobs/{job_id}/events", params=params)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def artifacts(self, job_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/v1/jobs/{job_id}/artifacts")["data"]

    def delete(self, job_id: str) -> None:
        self._call("DELETE", f"/v1/jobs/{job_id}")

    def upload_model(
        self,
        path: Path,
        name: str | None = None,
        retention_seconds: int | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        presigned: bool = False,
    ) -> dict[str, Any]:
        """Uploads the model: a folder packed as a tar (its files at the top), a `.gguf` file as it is;
        `on_progress(sent, total)` as the bytes go. `presigned`: PUT straight into the service's bucket, then
        completed (S3 storage only). Returns the uploaded model (`model`: what a job names to prune it)."""
        is_gguf = path.name.lower().endswith(GGUF_SUFFIX)
        # A folder named `.` is named by where it is; a GGUF file by its own name, even as a link to a blob.
        fields: dict[str, Any] = {"name": name or (path.name if is_gguf else path.resolve().name)}
        if retention_seconds is not None:
            fields["retention_seconds"] = retention_seconds
        with contextlib.ExitStack() as stack:
            if is_gguf:
                body = stack.enter_context(path.open("rb"))
                body.seek(0, 2)
            else:
                body = stack.enter_context(tempfile.TemporaryFile())
                with tarfile.open(fileobj=body, mode="w") as tar:
                    for file in sorted(path.iterdir()):
                        tar.add(file, arcname=file.name)
            total = body.tell()
            body.seek(0)
            sent = 0

            def counted(size: int) -> None:
                nonlocal sent
                sent += size
                if on_progress:
                    on_progress(min(sent, total), total)

            reader = ReadProgress(body, counted)
            if presigned:
                upload = self._call("POST", "/v1/models/presigned", json=fields)
                put = httpx.put(
                    upload["upload_url"],
                    content=iter(lambda: reader.read(PUT_CHUNK_BYTES), b""),
                    headers={"Content-Length": str(total)},
                    timeout=self.http.timeout,
                )
                if not put.is_success:  # the S3 server's own answer (XML), not the service's error shape
                    raise CaspAPIError(put.status_code, f"the presigned upload was refused: {put.text[:300]}")
                return self._call("POST", upload["complete_url"])
            form = {key: str(value) for key, value in fields.items()}
            part = (
                (path.name, reader, "application/octet-stream")
                if is_gguf
                else ("model.tar", reader, "application/x-tar")
            )
            files = {"file": part}
            return self._call("POST", "/v1/models", files=files, data=form)

    def models(self, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        params = {"limit": limit, **({"after": after} if after else {})}
        return self._call("GET", "/v1/models", params=params)

    def delete_model(self, model_id: str) -> None:
        self._call("DELETE", f"/v1/models/{model_id}")

    def wait(
        self,
        job_id: str,
        timeout: float | None = None,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Follows the job's events as the server streams them (Server-Sent Events) until it has finished;
        returns the job. `on_update` gets each event (`status`, `stage`, `progress`, `message`, ...). A stream
        cut short (the server restarted) is taken up again after the last event seen. Raises TimeoutError past
        `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last: int | None = None

        def check_deadline() -> None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {self.get(job_id)['status']} after {timeout} s")

        while True:
            try:
                for event in self._event_stream(job_id, last, deadline):
                    if event is not None:
                        last = event["id"]
                        if on_update:
                            on_update(event)
                    check_deadline()
            except (httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ReadError):
                check_deadline()
            except CaspAPIError as error:
                if error.status_code != 429:
                    raise
                # The key holds all the streams the server allows (CASP_MAX_STREAMS_PER_KEY): poll a while.
                last = self._poll_events(job_id, last, on_update, check_deadline)
            job = self.get(job_id)
            if job["status"] in FINISHED:
                return job
            check_deadline()

    def _poll_events(
        self,
        job_id: str,
        after: int | None,
        on_update: Callable[[dict[str, Any]], None] | None,
        check_deadline: Callable[[], None],
    ) -> int | None:
        """The job's events by pages for POLL_INSTEAD_SECONDS (or until it has finished); the last id seen."""
        until = time.monotonic() + POLL_INSTEAD_SECONDS
        while True:
            page = self.events(job_id, after=after)
            for event in page["data"]:
                after = event["id"]
                if on_update:
                    on_update(event)
            if page["has_more"]:
                continue
            if time.monotonic() > until or self.get(job_id)["status"] in FINISHED:
                return after
            check_deadline()
            time.sleep(POLL_SECONDS)

    def _event_stream(self, job_id: str, after: int | None, deadline: float | None) -> Iterator[dict[str, Any] | None]:
        """The events of one `?stream=true` answer; None for each keep-alive comment, so the caller can look at
        the clock while nothing happens."""
        params: dict[str, Any] = {"stream": "true", **({"after": after} if after is not None else {})}
        read = self.http.timeout.read or STREAM_READ_SECONDS
        if deadline is not None:
            read = max(0.1, min(read, deadline - time.monotonic()))
        timeout = httpx.Timeout(self.http.timeout.connect, read=read)
        with self.http.stream("GET", f"/v1/jobs/{job_id}/events", params=params, timeout=timeout) as response:
            self._raise_for(response)
            data: list[str] = []
            for line in response.iter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                elif not line and data:  # a blank line ends an event
                    yield json.loads("\n".join(data))
                    data = []
                elif line.startswith(":"):
                    yield None

    def download(self, job_id: str, dest: Path) -> list[Path]:
        """Downloads every artifact into `dest`, keeping the checkpoint's layout, and checks each sha256.
        Raises ArtifactError at the first artifact that fails the check (or whose name would leave `dest`)."""
        dest = dest.resolve()
        paths = []
        # The URLs carry their own credentials (signed); an Authorization header would upset S3.
        with httpx.Client(timeout=self.http.timeout, transport=self._transport()) as plain:
            for artifact in self.artifacts(job_id):
                path = (dest / artifact["name"]).resolve()
                if not path.is_relative_to(dest):
                    raise ArtifactError("unsafe_name", f"artifact name leaves the target folder: {artifact['name']!r}")
                path.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                with plain.stream("GET", artifact["url"]) as response, path.open("wb") as out:
                    if response.is_error:
                        raise CaspAPIError(response.status_code, f"download of {artifact['name']} refused")
                    for chunk in response.iter_bytes():
                        digest.update(chunk)
                        out.write(chunk)
                if digest.hexdigest() != artifact["sha256"]:
                    path.unlink()  # what arrived is not the artifact: no file of a checkpoint may look complete
                    raise ArtifactError(
                        "sha256_mismatch",
                        f"{artifact['name']}: the service lists sha256 {artifact['sha256']}, the download has "
                        f"{digest.hexdigest()}; the file was not kept",
                    )
                paths.append(path)
        return paths
