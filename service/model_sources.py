"""A job's model from a bucket (`s3://bucket/prefix`) or an upload (`casp://models/<id>`), made a local folder (or a
local GGUF file) for casp_core on the worker.

An upload on local storage is a folder or a GGUF file already. Anything in a bucket is downloaded into the worker's
model cache (CASP_MODEL_CACHE_DIR): one entry per set of objects (a folder's, or the one object of a GGUF file),
named by a digest of their keys, sizes and ETags, so a model whose objects are unchanged is read from S3 once, and
one whose objects changed is downloaded anew. A GGUF file's header is checked before it enters the cache, so a file
that is no model to prune is refused with casp_core's error and leaves nothing behind. A download goes
to a partial folder first and is renamed into the cache whole, so a download cut short never enters it. When the
cache holds more than CASP_MODEL_CACHE_MAX_BYTES, the least recently used entries go, except those a job is using
(each job holds a shared lock on its entry; eviction takes an exclusive one or leaves the entry). A download holds
an exclusive lock on its partial folder while it runs: a partial folder whose lock is free was left by a worker that
died mid-download, and goes the next time the cache adds or finds an entry.
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from botocore.exceptions import ClientError
from sqlalchemy.orm import Session

from casp_core.artifacts.caches import BoundedCache
from casp_core.artifacts.gguf.source import GGUF_MAGIC, check_gguf_file
from casp_core.errors import Cancelled, InvalidModelFile, ModelNotFound
from casp_core.model import key_digest
from service.paths import S3_SCHEME, bucket_and_prefix, upload_id_of
from service.settings import Settings
from service.storage import S3Location, Storage, s3_client
from service.tables import UploadedModel

# (fraction done, message) as the download goes; the worker turns it into the job's progress and events.
Progress = Callable[[float, str], None]
CHUNK_BYTES = 8 << 20
# What S3 servers answer for a key that is not there (HEAD has no body, so no code but the status).
NO_SUCH_OBJECT = ("404", "NoSuchKey", "NotFound")


@dataclass(frozen=True)
class StoredObject:
    relative: str  # path under the model's prefix, with forward slashes; empty for a model that is one object
    size: int
    etag: str

    def key(self, location: S3Location) -> str:
        return f"{location.prefix}/{self.relative}" if self.relative else location.prefix

    def local_path(self, model: Path) -> Path:
        """Where it goes when the model is downloaded to `model` (a folder, or the GGUF file itself)."""
        return model / self.relative if self.relative else model


def bucket_location(model: str, settings: Settings) -> S3Location:
    """`s3://bucket/prefix` as the worker reads it, with the bucket's credentials."""
    bucket, parts = bucket_and_prefix(model)
    return S3Location(bucket, "/".join(parts), settings.bucket_credentials(bucket))


def locate(
    session: Session, model: str, owner_id: str | None, storage: Storage, settings: Settings
) -> Path | S3Location:
    """Where a bucket's or an upload's model is. An upload must still exist and be the job's key's own."""
    if model.startswith(S3_SCHEME):
        return bucket_location(model, settings)
    row = session.get(UploadedModel, upload_id_of(model))
    if row is None or row.owner_id != owner_id:
        raise ModelNotFound(f"the uploaded model {model} does not exist (deleted or expired) or is another key's")
    return storage.model_location(row.id, row.name)


def refused(location: S3Location, exc: ClientError, what: str) -> ModelNotFound:
    """A wrong key, no such bucket, no right to read it: the job's error (or the submit's 422), not a crash."""
    code = exc.response.get("Error", {}).get("Code", "an error")
    return ModelNotFound(
        f"{location}: the S3 server refused to {what} it ({code}); the bucket is read with its entry of"
        " CASP_MODEL_BUCKET_CREDENTIALS, else CASP_S3_*"
    )


def list_objects(client: object, location: S3Location) -> list[StoredObject]:
    """The objects of the model's folder, or the one object of a GGUF file; the folder markers some tools write (keys
    ending in `/`) are skipped."""
    if location.is_gguf_file:
        try:
            head = client.head_object(Bucket=location.bucket, Key=location.prefix)  # type: ignore[attr-defined]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in NO_SUCH_OBJECT:
                raise ModelNotFound(f"{location}: no such object") from exc
            raise refused(location, exc, "read") from exc
        return [StoredObject("", head["ContentLength"], head["ETag"])]
    objects = []
    paginator = client.get_paginator("list_objects_v2")  # type: ignore[attr-defined]
    try:
        for page in paginator.paginate(Bucket=location.bucket, Prefix=location.prefix + "/"):
            for item in page.get("Contents", []):
                relative = item["Key"][len(location.prefix) + 1 :]
                if relative and not relative.endswith("/"):
                    if any(part in ("", ".", "..") for part in relative.split("/")):
                        raise ModelNotFound(f"{location}: the object name {relative!r} cannot be a file name")
                    objects.append(StoredObject(relative, item["Size"], item["ETag"]))
    except ClientError as exc:
        raise refused(location, exc, "list") from exc
    if not objects:
        raise ModelNotFound(f"{location}: no objects under this prefix")
    return sorted(objects, key=lambda stored: stored.relative)


def check_gguf_object(location: S3Location) -> None:
    """What the API checks of a GGUF file in a bucket at submit, without downloading it: that the object is there
    and starts as a GGUF file does. The rest of its header is checked once a worker has downloaded it."""
    client = s3_client(location.credentials)
    try:
        start = client.get_object(Bucket=location.bucket, Key=location.prefix, Range=f"bytes=0-{len(GGUF_MAGIC) - 1}")
        magic = start["Body"].read()
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        if code in NO_SUCH_OBJECT:
            raise ModelNotFound(f"{location}: no such object") from exc
        if code != "InvalidRange":  # an empty object has no first bytes to read
            raise refused(location, exc, "read") from exc
        magic = b""
    if magic != GGUF_MAGIC:
        name = location.prefix.rsplit("/", 1)[-1]
        raise InvalidModelFile(f"{name} is not a GGUF file: it does not start with the GGUF magic bytes")


def entry_name(location: S3Location, objects: list[StoredObject]) -> str:
    described = [str(location), *(f"{o.relative}\n{o.size}\n{o.etag}" for o in objects)]
    return key_digest(described)[:32]


def megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


class ModelCache(BoundedCache):
    @contextlib.contextmanager
    def local_copy(self, location: S3Location, progress: Progress, should_cancel: Callable[[], bool]) -> Iterator[Path]:
        """The model's local folder (or GGUF file), `<entry>/<the prefix's last part>` (casp_core names a local model
        by its folder's last part, a GGUF file by its name), held in the cache while the block runs."""
        name = location.prefix.rsplit("/", 1)[-1]
        client = s3_client(location.credentials)
        objects = list_objects(client, location)
        entry = entry_name(location, objects)
        with self.exclusive():
            self.remove_abandoned_partials()
            cached = self.has(entry)
        if cached:
            progress(1.0, f"{location}: in the model cache, its objects unchanged; nothing downloaded")
        else:
            self._download(client, location, objects, entry, name, progress, should_cancel)
        with self.held(entry, f"{location}: evicted from the model cache before the job could use it") as folder:
            yield folder / name

    def _download(
        self,
        client: object,
        location: S3Location,
        objects: list[StoredObject],
        entry: str,
        name: str,
        progress: Progress,
        should_cancel: Callable[[], bool],
    ) -> None:
        total = sum(stored.size for stored in objects) or 1
        done = 0
        with self.partial() as partial:
            for stored in objects:
                target = stored.local_path(partial / name)
                target.parent.mkdir(parents=True, exist_ok=True)
                key = stored.key(location)
                body = client.get_object(Bucket=location.bucket, Key=key)["Body"]  # type: ignore[attr-defined]
                with target.open("wb") as out:
                    for chunk in body.iter_chunks(CHUNK_BYTES):
                        if should_cancel():
                            raise Cancelled("the job was cancelled")
                        out.write(chunk)
                        done += len(chunk)
                        progress(done / total, f"downloading {location}: {megabytes(done)} of {megabytes(total)}")
            if location.is_gguf_file:  # casp_core's own check of its header, before the file enters the cache
                check_gguf_file(partial / name)
            self.add(partial, entry)
        files = f"{len(objects)} file{'s' if len(objects) > 1 else ''}"
        progress(1.0, f"downloaded {location}: {files}, {megabytes(total)}")


@contextlib.contextmanager
def local_model(
    source: Path | S3Location, settings: Settings, progress: Progress, should_cancel: Callable[[], bool]
) -> Iterator[Path]:
    """The folder (or GGUF file) casp_core loads: a local upload as it is, a bucket's model from the cache."""
    if isinstance(source, Path):
        if not source.exists():
            raise ModelNotFound("the uploaded model's files are gone from storage")
        progress(1.0, "the uploaded model is on this machine's storage; nothing downloaded")
        yield source
        return
    cache = ModelCache(settings.model_cache, settings.model_cache_max_bytes)
    with cache.local_copy(source, progress, should_cancel) as model:
        yield model
