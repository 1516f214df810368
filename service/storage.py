"""Where artifacts live: a local folder (`file://...`) or an S3-compatible bucket (`s3://bucket/prefix`).

Beside a job's artifacts (`jobs/<job id>/`) the storage keeps its work in progress (`work/<job id>/`: the
recovery stage's training state), so that a retry on another machine resumes it; that is never listed as an
artifact, and goes when the job ends or its artifacts are deleted."""

import hashlib
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import quote, urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from service.security import sign_download
from service.settings import S3Credentials, Settings


@dataclass(frozen=True)
class StoredFile:
    name: str  # path inside the job's output directory, with forward slashes
    size: int
    sha256: str


def sha256_of(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def files_of(directory: Path) -> list[tuple[str, Path]]:
    return sorted((p.relative_to(directory).as_posix(), p) for p in directory.rglob("*") if p.is_file())


def copy_whole(source: Path, target: Path) -> None:
    """Copy then rename: a reader never sees a half-written file."""
    partial = target.with_name(target.name + ".partial")
    shutil.copyfile(source, partial)
    partial.replace(target)


@dataclass(frozen=True)
class S3Location:
    """A model in a bucket, read with `credentials`: the objects under `prefix/`, or the one object `prefix` where
    that names a GGUF file."""

    bucket: str
    prefix: str
    credentials: S3Credentials

    @property
    def is_gguf_file(self) -> bool:
        # Imported here: casp_core.artifacts.gguf.source loads torch, which the admin commands that reach this module
        # (`casp keys ...` through service.api_keys) would otherwise pay for, ten seconds each.
        from casp_core.artifacts.gguf.source import is_gguf_reference

        return is_gguf_reference(self.prefix)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def s3_client(credentials: S3Credentials) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=credentials.endpoint_url,
        aws_access_key_id=credentials.access_key_id,
        aws_secret_access_key=credentials.secret_access_key,
        region_name=credentials.region,
        # Path-style addressing: S3-compatible servers (MinIO, SeaweedFS) rarely have bucket DNS names.
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )


class Storage(Protocol):
    def upload_dir(self, job_id: str, directory: Path) -> list[StoredFile]:
        """Uploads every file; uploading the same job again overwrites, so a rerun is safe."""

    def url(self, job_id: str, name: str, ttl_seconds: int, base_url: str) -> str:
        """A URL that downloads one artifact without credentials until it expires."""

    def delete(self, job_id: str) -> None:
        """Removes the job's artifacts and its work in progress."""

    def put_work(self, job_id: str, source: Path) -> None:
        """Stores one file of the job's work in progress under its name, replacing the one stored before."""

    def get_work(self, job_id: str, name: str, target: Path) -> bool:
        """Writes the stored work file `name` to `target` (whole or not at all); False when there is none."""

    def delete_work(self, job_id: str) -> None: ...

    def check_writable(self, min_free_bytes: int) -> None:
        """Raises unless a file can be written, and (where the storage has a size) at least `min_free_bytes`
        are free."""

    def put_model(self, model_id: str, name: str, source: Path) -> None:
        """Stores an uploaded model's folder as `models/<id>/<name>/`, or its GGUF file as `models/<id>/<name>` (its
        row, written after, makes it usable)."""

    def delete_model(self, model_id: str) -> None: ...

    def model_location(self, model_id: str, name: str) -> Path | S3Location:
        """Where a worker reads the uploaded model: a local folder or file, or a bucket's prefix it downloads."""


class LocalStorage:
    def __init__(self, root: Path, settings: Settings) -> None:
        self.root = root
        self.settings = settings  # the signing key is read only when a URL is signed (API side)

    def path(self, job_id: str, name: str) -> Path:
        base = (self.root / "jobs" / job_id).resolve()
        path = (base / name).resolve()
        if not path.is_relative_to(base):
            raise ValueError(f"artifact name escapes the job folder: {name!r}")
        return path

    def upload_dir(self, job_id: str, directory: Path) -> list[StoredFile]:
        stored = []
        for name, source in files_of(directory):
            target = self.path(job_id, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            copy_whole(source, target)
            stored.append(StoredFile(name, target.stat().st_size, sha256_of(target)))
        return stored

    def url(self, job_id: str, name: str, ttl_seconds: int, base_url: str) -> str:
        expires, signature = sign_download(self.settings.signing_key, job_id, name, ttl_seconds)
        return f"{base_url.rstrip('/')}/v1/files/{job_id}/{quote(name)}?expires={expires}&signature={signature}"

    def delete(self, job_id: str) -> None:
        shutil.rmtree(self.root / "jobs" / job_id, ignore_errors=True)
        self.delete_work(job_id)

    def work_path(self, job_id: str, name: str) -> Path:
        return self.root / "work" / job_id / name

    def put_work(self, job_id: str, source: Path) -> None:
        target = self.work_path(job_id, source.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        copy_whole(source, target)

    def get_work(self, job_id: str, name: str, target: Path) -> bool:
        source = self.work_path(job_id, name)
        if not source.is_file():
            return False
        copy_whole(source, target)
        return True

    def delete_work(self, job_id: str) -> None:
        shutil.rmtree(self.root / "work" / job_id, ignore_errors=True)

    def put_model(self, model_id: str, name: str, source: Path) -> None:
        target = self.model_location(model_id, name)
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            copy_whole(source, target)
        else:
            shutil.copytree(source, target, dirs_exist_ok=True)

    def delete_model(self, model_id: str) -> None:
        shutil.rmtree(self.root / "models" / model_id, ignore_errors=True)

    def model_location(self, model_id: str, name: str) -> Path:
        return self.root / "models" / model_id / name

    def check_writable(self, min_free_bytes: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        probe = self.root / f".ready-{uuid.uuid4().hex}"
        probe.write_bytes(b"ready")
        probe.unlink()
        free = shutil.disk_usage(self.root).free
        if free < min_free_bytes:
            raise OSError(f"{free} bytes free in {self.root}, below CASP_READY_MIN_FREE_BYTES ({min_free_bytes})")


class S3Storage:
    def __init__(self, bucket: str, prefix: str, settings: Settings) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.credentials = settings.storage_credentials
        self.client = s3_client(self.credentials)
        public = settings.s3_public_endpoint_url
        self.presigner = s3_client(self.credentials.model_copy(update={"endpoint_url": public})) if public else None

    def key(self, job_id: str, name: str = "", folder: str = "jobs") -> str:
        return "/".join(part for part in (self.prefix, folder, job_id, name) if part)

    def upload_dir(self, job_id: str, directory: Path) -> list[StoredFile]:
        stored = []
        for name, source in files_of(directory):
            digest = sha256_of(source)
            self.client.upload_file(str(source), self.bucket, self.key(job_id, name))
            stored.append(StoredFile(name, source.stat().st_size, digest))
        return stored

    def url(self, job_id: str, name: str, ttl_seconds: int, base_url: str) -> str:
        return (self.presigner or self.client).generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self.key(job_id, name)}, ExpiresIn=ttl_seconds
        )

    def delete(self, job_id: str) -> None:
        self._delete_under(self.key(job_id) + "/")
        self.delete_work(job_id)

    def put_work(self, job_id: str, source: Path) -> None:
        # An object upload replaces the old one whole: a reader gets the previous state or this one.
        self.client.upload_file(str(source), self.bucket, self.key(job_id, source.name, "work"))

    def get_work(self, job_id: str, name: str, target: Path) -> bool:
        partial = target.with_name(target.name + ".partial")
        try:
            self.client.download_file(self.bucket, self.key(job_id, name, "work"), str(partial))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                return False
            raise
        partial.replace(target)
        return True

    def delete_work(self, job_id: str) -> None:
        self._delete_under(self.key(job_id, folder="work") + "/")

    def _delete_under(self, prefix: str) -> None:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
            objects = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if objects:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": objects})

    def put_model(self, model_id: str, name: str, source: Path) -> None:
        if source.is_file():
            self.client.upload_file(str(source), self.bucket, self.key(model_id, name, "models"))
            return
        for relative, path in files_of(source):
            self.client.upload_file(str(path), self.bucket, self.key(model_id, f"{name}/{relative}", "models"))

    def delete_model(self, model_id: str) -> None:
        self._delete_under(self.key(model_id, folder="models") + "/")

    def model_location(self, model_id: str, name: str) -> S3Location:
        return S3Location(self.bucket, self.key(model_id, name, "models"), self.credentials)

    def _pending_key(self, upload_id: str) -> str:
        return self.key(f"{upload_id}.tar", folder="model-uploads")

    def pending_upload_url(self, upload_id: str, ttl_seconds: int) -> str:
        """A URL that PUTs the tar of a presigned model upload without credentials until it expires."""
        return (self.presigner or self.client).generate_presigned_url(
            "put_object", Params={"Bucket": self.bucket, "Key": self._pending_key(upload_id)}, ExpiresIn=ttl_seconds
        )

    def pending_upload_size(self, upload_id: str) -> int | None:
        """The size of the tar PUT to the upload's URL; None while nothing was."""
        try:
            return self.client.head_object(Bucket=self.bucket, Key=self._pending_key(upload_id))["ContentLength"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def read_pending_upload(self, upload_id: str, target: BinaryIO) -> None:
        self.client.download_fileobj(self.bucket, self._pending_key(upload_id), target)

    def delete_pending_upload(self, upload_id: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._pending_key(upload_id))

    def check_writable(self, min_free_bytes: int) -> None:
        # A bucket has no free space to read: only writing is checked.
        key = "/".join(part for part in (self.prefix, f".ready-{uuid.uuid4().hex}") if part)
        self.client.put_object(Bucket=self.bucket, Key=key, Body=b"ready")
        self.client.delete_object(Bucket=self.bucket, Key=key)


def make_storage(settings: Settings) -> Storage:
    url = urlparse(settings.storage)
    if url.scheme == "file":
        return LocalStorage(Path(url.path), settings)
    if url.scheme == "s3":
        return S3Storage(url.netloc, url.path, settings)
    raise ValueError(f"CASP_STORAGE_URL: unsupported scheme {url.scheme!r} (use file:// or s3://)")
