"""Request and response bodies of the HTTP API."""

import re
from copy import copy
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import Path as PathParam
from pydantic import BaseModel, Field, StringConstraints, field_validator

from casp_core.model import is_local_reference
from casp_core.settings import Printable, PruneSettings, is_optional, part_of
from service.paths import S3_SCHEME, UPLOAD_SCHEME
from service.settings import DEVICES
from service.tables import JOB_STATUSES
from service.webhook_deliveries import WEBHOOK_EVENTS

MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64), Printable]
MetadataValue = Annotated[str, StringConstraints(max_length=512), Printable]

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")
# Job ids are uuid4 hex; the pattern keeps anything else (a NUL, a megabyte) away from the database.
JOB_ID_PATTERN = r"^[0-9a-f]{1,32}$"
JobIdText = Annotated[str, StringConstraints(pattern=JOB_ID_PATTERN)]
JobId = Annotated[str, PathParam(pattern=JOB_ID_PATTERN, description="the job's id")]
MAX_EVENT_ID = 2**63 - 1  # a BIGINT


def strict_model(model: type[BaseModel]) -> type[BaseModel]:
    """`model`, and the setting models it nests, validated strictly: a number must be a JSON number (`"0.2"` is
    refused), a boolean a JSON boolean. casp_core's own models convert, as its command line's flags need."""
    namespace: dict[str, Any] = {
        "model_config": {**model.model_config, "strict": True},
        "__module__": __name__,
        "__doc__": model.__doc__,
        "__annotations__": {},
    }
    for name, info in model.model_fields.items():
        part = part_of(info.annotation)
        if part is None:
            continue
        nested = strict_model(part)
        field = copy(info)
        if is_optional(info.annotation):  # `target`: absent unless given
            field.annotation = nested | None
        else:
            field.annotation, field.default_factory = nested, nested
        namespace["__annotations__"][name] = field.annotation
        namespace[name] = field
    return type(model.__name__, (model,), namespace)


class JobCreate(strict_model(PruneSettings)):  # type: ignore[misc]
    """The pruning settings are casp_core's own (casp_core.settings.PruneSettings: names, defaults, ranges and
    descriptions), validated strictly; the fields here are the service's: what to prune, where, and labels."""

    model: Annotated[str, Printable] = Field(
        min_length=1,
        max_length=1024,
        description="Hugging Face id `org/name`, an absolute local path (a model folder, or a `.gguf` file),"
        " `s3://bucket/prefix` (a folder, or one `.gguf` object, in a bucket the server allows) or"
        " `casp://models/<id>` (a model this key uploaded)",
    )
    revision: Annotated[str, Printable] | None = Field(None, min_length=1, max_length=200)
    device: Literal[DEVICES] | None = Field(  # type: ignore[valid-type]
        None,
        description="which worker queue runs the job; default: the server's CASP_DEFAULT_DEVICE, whose default"
        " `auto` is the device of the machine that runs the job",
    )
    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=16)
    retention_seconds: int | None = Field(
        None,
        gt=0,
        description="how long the artifacts are kept after the job succeeds, then deleted; default: the server's"
        " CASP_ARTIFACT_RETENTION_SECONDS (7 days), at most its CASP_MAX_ARTIFACT_RETENTION_SECONDS (30 days)",
    )
    webhook_url: Annotated[str, Printable] | None = Field(
        None,
        max_length=2048,
        description="posted the job (its JSON, as GET returns it) when it ends, signed as Standard Webhooks have it"
        " (headers `webhook-id`, `webhook-timestamp`, `webhook-signature`) with the server's CASP_WEBHOOK_SECRET;"
        " its host must be one of CASP_WEBHOOK_ALLOWED_HOSTS",
    )
    webhook_events: list[Literal[WEBHOOK_EVENTS]] | None = Field(  # type: ignore[valid-type]
        None,
        min_length=1,
        max_length=len(WEBHOOK_EVENTS),
        description="the events `webhook_url` receives; default the final three (`job.succeeded`, `job.failed`,"
        " `job.cancelled`); `job.stage` adds one delivery per stage an attempt starts",
    )

    @field_validator("webhook_events")
    @classmethod
    def _events_once(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) < len(value):
            raise ValueError("names an event twice")
        return value

    @field_validator("model")
    @classmethod
    def _model_shape(cls, value: str) -> str:
        if value.startswith(("/", S3_SCHEME, UPLOAD_SCHEME)) or HUB_ID.match(value):
            return value
        if is_local_reference(value):
            raise ValueError("local paths must be absolute")
        raise ValueError(
            "must be a Hugging Face id `org/name`, an absolute local path, `s3://bucket/prefix` or `casp://models/<id>`"
        )

    def settings(self) -> dict[str, Any]:
        """The pruning settings alone, as PruneSettings has them."""
        return self.model_dump(include=set(PruneSettings.model_fields))


# POST /v1/jobs's examples in /docs and /openapi.json: a ratio, and each form of a budget (README, "Prune to a
# budget"). tests/api/test_budget_targets.py submits each.
JOB_EXAMPLES: dict[str, dict[str, Any]] = {
    "ratio": {
        "summary": "Prune by a ratio",
        "value": {"model": "meta-llama/Llama-3.1-8B", "ratio": 0.3, "export": ["gguf"], "gguf_type": "q4_k_m"},
    },
    "max_bytes": {
        "summary": "The best GGUF file within 6 GB",
        "description": "Each ratio in each GGUF type; the lowest perplexity whose file fits.",
        "value": {"model": "meta-llama/Llama-3.1-8B", "target": {"max_bytes": "6GB", "format": "gguf"}},
    },
    "max_params": {
        "summary": "The best model with at most 6 B parameters",
        "description": "Every parameter counts: embedding and head included, a tied one once.",
        "value": {
            "model": "meta-llama/Llama-3.1-8B",
            "target": {"max_params": 6_000_000_000},
            "ratios": [0.1, 0.2, 0.3],
        },
    },
    "max_perplexity_increase": {
        "summary": "The smallest file whose perplexity rises by at most 10 %",
        "description": "On the first evaluation text, against the dense model's.",
        "value": {
            "model": "meta-llama/Llama-3.1-8B",
            "target": {"max_perplexity_increase": 0.1},
            "export": ["gguf"],
            "gguf_types": ["q8_0", "q5_k_m", "q4_k_m"],
        },
    },
}


class JobError(BaseModel):
    code: str
    message: str


class JobOut(BaseModel):
    id: str
    status: Literal[JOB_STATUSES]  # type: ignore[valid-type]
    stage: str | None
    progress: float = Field(description="0-100")
    model: str
    revision: str | None
    device: str
    settings: dict[str, Any] = Field(description="the pruning settings the job runs with")
    metadata: dict[str, str]
    cancel_requested: bool
    attempts: int
    error: JobError | None
    result: dict[str, Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    expires_at: datetime | None = Field(
        description="when the artifacts of a succeeded job are (or were) deleted; then `GET` on them answers 410"
    )
    webhook_url: str | None
    webhook_events: list[str] | None = Field(description="the events `webhook_url` receives; null without one")
    webhook_state: Literal["pending", "delivered", "failed", "skipped"] | None = Field(
        description="pending until the job's end is posted to `webhook_url`; each attempt is an event; skipped when"
        " the job ended in a way its `webhook_events` leave out"
    )


class JobList(BaseModel):
    data: list[JobOut]
    has_more: bool


class EventOut(BaseModel):
    id: int
    attempt: int
    kind: str = Field(description="status, progress or warning (settings that forfeit the speedup)")
    status: str
    stage: str | None
    progress: float
    message: str
    created_at: datetime


class EventList(BaseModel):
    data: list[EventOut]
    has_more: bool


class ArtifactOut(BaseModel):
    name: str = Field(description="path inside the checkpoint directory")
    size: int
    sha256: str
    url: str
    expires_at: datetime


class ArtifactList(BaseModel):
    data: list[ArtifactOut]


class LimitsOut(BaseModel):
    max_active_jobs: int = Field(description="jobs queued or running at once")
    max_submissions_per_minute: int = Field(description="jobs submitted in any 60 s")


class UsageOut(BaseModel):
    key_name: str | None = Field(description="the API key asking; null when the server runs without keys")
    limits: LimitsOut | None = Field(description="the key's limits (its own, else the server's); null without keys")
    active_jobs: int = Field(description="jobs queued or running")
    submissions_last_minute: int
    storage_bytes: int = Field(description="size of the artifacts kept for the key's jobs")
    artifact_files: int


# An uploaded model's folder name: what its model card calls it.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
ModelId = Annotated[str, PathParam(pattern=r"^[0-9a-f]{32}$", description="the uploaded model's id")]


class HubTokenIn(BaseModel):
    model_config = {"extra": "forbid", "strict": True}

    # A Hugging Face token is `hf_` and a few dozen characters; no whitespace, so a pasted line break is refused.
    token: str = Field(min_length=1, max_length=1000, pattern=r"^\S+$", description="the Hugging Face token")


class ModelOut(BaseModel):
    id: str
    model: str = Field(description="what a job names as its `model` to prune this one: `casp://models/<id>`")
    name: str = Field(
        description="the folder's name, as the pruned model's card calls it; a GGUF file's, ending in `.gguf`"
    )
    model_type: str
    size: int = Field(description="bytes of all its files")
    files: int
    created_at: datetime
    expires_at: datetime = Field(description="when it is deleted (after CASP_ARTIFACT_RETENTION_SECONDS or its own)")


class PresignedUploadIn(BaseModel):
    model_config = {"extra": "forbid", "strict": True}

    name: str | None = Field(
        None,
        pattern=MODEL_NAME_PATTERN,
        description="the model's name (its pruned model card's); default: the archive's top folder, or `model`. A name"
        " ending in `.gguf` says the upload is a GGUF file, not a tar",
    )
    retention_seconds: int | None = Field(
        None, gt=0, description="how long it is kept; default CASP_ARTIFACT_RETENTION_SECONDS, at most the maximum"
    )


class PresignedUploadOut(BaseModel):
    id: str = Field(description="the upload's id, and the model's once completed")
    upload_url: str = Field(
        description="PUT the tar (optionally gzip-compressed), or the GGUF file, here, with no other credentials"
    )
    upload_method: Literal["PUT"]
    upload_expires_at: datetime = Field(description="when the URL stops taking the tar (CASP_URL_TTL_SECONDS)")
    complete_url: str = Field(description="POST here once the file is uploaded: `/v1/models/{id}/complete`")


class ModelList(BaseModel):
    data: list[ModelOut]
    has_more: bool


class ModelChoice(BaseModel):
    model: str = Field(description="what a job names as its `model` to prune this one")
    name: str = Field(
        description="an upload's name; a local model's path from its allowed root's folder on (`demo/stories260K`)"
    )
    source: Literal["upload", "local"] = Field(
        description="upload: this key's (GET /v1/models); local: found under CASP_ALLOWED_MODEL_ROOTS"
    )
    format: Literal["folder", "gguf"]


class ModelChoiceList(BaseModel):
    data: list[ModelChoice] = Field(description="this key's uploads, newest first, then the local models by path")
    truncated: bool = Field(description="more were found than listed (the newest 100 uploads, 200 local models)")


class ModelCheckOut(BaseModel):
    model: str = Field(
        description="the model as a job would store it: a local path resolved, a bucket's prefix normalised"
    )
