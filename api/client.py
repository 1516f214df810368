"""A small Python client of the jobs API, for internal tooling and the `casp submit|status|wait|download`
commands."""

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

FINISHED = ("succeeded", "failed", "cancelled")


class CaspAPIError(Exception):
    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.detail = detail


class CaspClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def __enter__(self) -> "CaspClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        if response.is_error:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise CaspAPIError(response.status_code, detail)
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

    def wait(
        self,
        job_id: str,
        timeout: float | None = None,
        poll_seconds: float = 1.0,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Polls until the job has finished; returns it. Raises TimeoutError past `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.get(job_id)
            if on_update:
                on_update(job)
            if job["status"] in FINISHED:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job['status']} after {timeout} s")
            time.sleep(poll_seconds)

    def download(self, job_id: str, dest: Path) -> list[Path]:
        """Downloads every artifact into `dest`, keeping the checkpoint's layout, and checks each sha256."""
        dest = dest.resolve()
        paths = []
        # The URLs carry their own credentials (signed); an Authorization header would upset S3.
        with httpx.Client(timeout=self.http.timeout) as plain:
            for artifact in self.artifacts(job_id):
                path = (dest / artifact["name"]).resolve()
                if not path.is_relative_to(dest):
                    raise ValueError(f"artifact name leaves the target folder: {artifact['name']!r}")
                path.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                with plain.stream("GET", artifact["url"]) as response, path.open("wb") as out:
                    if response.is_error:
                        raise CaspAPIError(response.status_code, f"download of {artifact['name']} refused")
                    for chunk in response.iter_bytes():
                        digest.update(chunk)
                        out.write(chunk)
                if digest.hexdigest() != artifact["sha256"]:
                    raise ValueError(f"{artifact['name']}: sha256 mismatch")
                paths.append(path)
        return paths
