"""Service settings, read from the environment (prefix `CASP_`)."""

import base64
import binascii
import os
import secrets
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from casp_core.errors import InvalidConfig
from service.logs import LogFormat

DEVICES = ("cpu", "cuda")
# "auto": the device of the machine the job lands on. Resolved where that is known (the embedded service at
# start, a worker for what it serves); the distributed API sends such jobs to the queue every worker reads.
AUTO = "auto"
# A webhook secret in the Standard Webhooks form: this prefix, then the base64 of the HMAC key.
WEBHOOK_SECRET_PREFIX = "whsec_"


def webhook_key_of(secret: str) -> bytes:
    """The HMAC key a webhook secret stands for: for `whsec_<base64>`, the bytes the base64 encodes, as the Standard
    Webhooks libraries read it (padding optional); for any other string, its UTF-8 bytes. ValueError when what
    follows `whsec_` is not base64, or encodes no byte."""
    if not secret.startswith(WEBHOOK_SECRET_PREFIX):
        return secret.encode()
    encoded = secret.removeprefix(WEBHOOK_SECRET_PREFIX)
    form = (
        "a whsec_ secret is the Standard Webhooks form, whsec_ and the base64 of the key"
        " (`casp webhooks secret` makes one)"
    )
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{form}, and what follows whsec_ here is not base64 ({exc})") from None
    if not key:
        raise ValueError(f"{form}, and nothing follows whsec_ here")
    return key


class S3Credentials(BaseModel):
    """Where and as whom to reach an S3 API: the artifact storage's (CASP_S3_*), or a model bucket's own."""

    model_config = ConfigDict(extra="forbid")

    endpoint_url: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    region: str = "us-east-1"


class Settings(BaseSettings):
    # hide_input_in_errors: a refused value may be a secret, which an error (or its traceback) must not show.
    model_config = SettingsConfigDict(env_prefix="CASP_", extra="ignore", hide_input_in_errors=True)

    home: Path = Field(default_factory=lambda: Path.home() / ".casp")
    # Defaults derived from `home` (see the properties below) keep the embedded mode zero-configuration.
    database_url: str | None = None
    # Unset: the embedded mode, where an in-process worker claims queued jobs straight from the database.
    broker_url: str | None = None
    storage_url: str | None = None
    s3_endpoint_url: str | None = None
    # Where clients reach the S3 server, when it differs from where the service does (`minio:9000` inside
    # docker compose): download URLs and presigned model uploads are signed for this host.
    s3_public_endpoint_url: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    s3_region: str = "us-east-1"
    # NoDecode: the variable is colon-separated like PATH, not JSON.
    allowed_model_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    datasets_dir: Path | None = None
    # Buckets jobs may read models from (`s3://bucket/prefix`), comma-separated: `bucket` (all of it) or
    # `bucket/prefix` (what lies under that folder); like CASP_ALLOWED_MODEL_ROOTS for local paths.
    allowed_model_buckets: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Credentials of model buckets that the artifact storage's (CASP_S3_*) cannot read, by bucket name (JSON:
    # {"models": {"endpoint_url": ..., "access_key_id": ..., "secret_access_key": ..., "region": ...}}).
    model_bucket_credentials: dict[str, S3Credentials] = Field(default_factory=dict)
    # Where workers keep models downloaded from buckets (and uploads on S3 storage), by the objects' ETags; the
    # least recently used go once the cache holds more than its bound.
    model_cache_dir: Path | None = None
    # What casp_core computes once per model (`cache`).
    cache_dir: Path | None = None
    model_cache_max_bytes: int = Field(default=100 << 30, ge=0)
    # A model upload (`POST /v1/models`, a tar of its folder) may be this large; other requests CASP_MAX_REQUEST_BYTES.
    max_upload_bytes: int = Field(default=50 << 30, ge=1024)
    auth: Literal["apikey", "none"] = "apikey"
    secret_key: str | None = None
    # Secrets used before `secret_key`, comma-separated: links they signed stay valid until they expire, so
    # that the secret can be rotated without breaking links already handed out (docs/operations.md).
    previous_secret_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    public_url: str | None = None  # base of signed download URLs on local storage; default: the request's
    url_ttl_seconds: int = Field(default=3600, gt=0)
    job_time_limit_seconds: int = Field(default=6 * 3600, gt=0)
    heartbeat_interval_seconds: float = Field(default=10.0, gt=0)
    heartbeat_timeout_seconds: float = Field(default=120.0, gt=0)
    reaper_interval_seconds: float = Field(default=30.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    default_device: Literal["auto", "cpu", "cuda"] = AUTO
    embedded_workers: int = Field(default=1, ge=0)
    # /readyz answers 503 when the artifact storage has less free space than this (local storage only).
    ready_min_free_bytes: int = Field(default=1 << 30, ge=0)
    # A job request is a few KiB; anything much larger is refused (413) before it is read.
    max_request_bytes: int = Field(default=64 * 1024, ge=1024)
    # Fair use, per API key (a key's own values, set with `casp keys create`, take precedence): jobs queued or
    # running at once, and jobs submitted in any 60 s. Not applied with CASP_AUTH=none (there are no keys).
    max_active_jobs: int = Field(default=8, ge=1)
    max_submissions_per_minute: int = Field(default=30, ge=1)
    # Event streams (`/v1/jobs/{id}/events?stream=true`) one key may hold open at once, per API process; they
    # cost no database connection while they wait, but a client that opens them by the thousand is told to poll.
    max_streams_per_key: int = Field(default=20, ge=1)
    # Artifacts of a succeeded job are deleted this long after it finished; a job may ask for another time
    # (`retention_seconds`) up to the maximum.
    artifact_retention_seconds: int = Field(default=7 * 86400, gt=0)
    max_artifact_retention_seconds: int = Field(default=30 * 86400, gt=0)
    # Webhooks (a job's `webhook_url`): off until a secret to sign them with is set (`whsec_<base64>`, the Standard
    # Webhooks form, or a raw string: see `webhook_key_of`). Hosts a URL may name, comma-separated
    # (`hooks.example.com`, `*.example.com`); addresses that are not public (private, loopback, link-local) are
    # refused unless allowed.
    webhook_secret: str | None = None
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    webhook_allow_private: bool = False
    webhook_max_attempts: int = Field(default=5, ge=1)
    webhook_backoff_seconds: float = Field(default=2.0, gt=0)  # doubled after each failed attempt, up to 60 s
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    webhook_poll_seconds: float = Field(default=2.0, gt=0)
    # "json": one JSON object a line, with the job's id, key name and stage (service.logs); for collectors.
    log_format: LogFormat = "text"

    @field_validator("allowed_model_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            return [part for part in value.split(":") if part]
        return value

    @field_validator("webhook_allowed_hosts", "previous_secret_keys", "allowed_model_buckets", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("webhook_secret")
    @classmethod
    def _webhook_key_readable(cls, value: str | None) -> str | None:
        if value is not None:
            webhook_key_of(value)
        return value

    @property
    def webhook_key(self) -> bytes | None:
        """The key webhooks are signed with (`webhook_key_of` the secret); None while they are off."""
        return webhook_key_of(self.webhook_secret) if self.webhook_secret else None

    @property
    def embedded(self) -> bool:
        return not self.broker_url

    @property
    def database(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'casp.db'}"

    @property
    def storage(self) -> str:
        return self.storage_url or f"file://{self.home / 'artifacts'}"

    @property
    def model_cache(self) -> Path:
        return self.model_cache_dir or self.home / "model-cache"

    @property
    def cache(self) -> Path:
        """What workers compute once per model and reuse (casp_core.artifacts.caches): GGUF sources dequantized, the
        dense models' evaluations. CASP_CACHE_DIR, the variable casp_core and the CLI read, else `home`/cache."""
        return self.cache_dir or self.home / "cache"

    @property
    def storage_credentials(self) -> S3Credentials:
        return S3Credentials(
            endpoint_url=self.s3_endpoint_url,
            access_key_id=self.s3_access_key_id,
            secret_access_key=self.s3_secret_access_key,
            region=self.s3_region,
        )

    def bucket_credentials(self, bucket: str) -> S3Credentials:
        """A model bucket's own credentials where set, else the artifact storage's."""
        return self.model_bucket_credentials.get(bucket) or self.storage_credentials

    @cached_property
    def signing_key(self) -> bytes:
        """The URL signing secret; generated once and kept in `home` when not configured, so that
        signed URLs survive a restart of a single-machine install."""
        if self.secret_key:
            return self.secret_key.encode()
        path = self.home / "secret_key"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(secrets.token_urlsafe(32))
            path.chmod(0o600)
        return path.read_text().strip().encode()

    @property
    def verification_keys(self) -> list[bytes]:
        """Secrets a signed URL may carry: the current one, then the previous ones."""
        return [self.signing_key, *(secret.encode() for secret in self.previous_secret_keys)]

    def model_roots(self) -> list[Path]:
        return [root.expanduser().resolve() for root in self.allowed_model_roots]


def load_settings() -> Settings:
    """The settings from the environment; InvalidConfig, one line naming each variable refused and why (never its
    value, which may be a secret), where one is wrong."""
    try:
        return Settings()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            field, *inside = (str(part) for part in error["loc"])
            where = f" ({'.'.join(inside)})" if inside else ""
            problems.append(f"CASP_{field.upper()}{where}: {error['msg'].removeprefix('Value error, ')}")
        raise InvalidConfig("; ".join(problems)) from None


def local_devices() -> tuple[str, ...]:
    """The devices jobs can run on here. Imports torch: call it only where jobs run."""
    # Asked through NVML, which leaves CUDA uninitialised: `casp worker` asks before Celery forks the pool
    # children that run the jobs, and CUDA initialised in a parent cannot be used in a forked child.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return DEVICES if torch.cuda.is_available() else ("cpu",)


def resolve_device(device: str) -> str:
    """`auto` becomes cuda when this machine has it, else cpu; a named device stays as it is."""
    if device != AUTO:
        return device
    return "cuda" if "cuda" in local_devices() else "cpu"
