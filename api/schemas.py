"""Request and response bodies of the HTTP API."""

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import Path as PathParam
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, field_validator

from api.core.settings import DEVICES
from api.models import JOB_STATUSES
from casp_core.config import (
    ALLOCATIONS,
    CALIBRATION_MODES,
    COMPENSATIONS,
    EXPORT_FORMATS,
    GGUF_TYPES,
    SOLVERS,
    ZERO_SHOT_TASKS,
)
from casp_core.model import is_local_reference

CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


def _no_control_characters(value: str) -> str:
    # A NUL cannot even be stored by PostgreSQL or put in a path; none of these belongs in a name.
    if CONTROL_CHARACTERS.search(value):
        raise ValueError("must not contain control characters")
    return value


Printable = AfterValidator(_no_control_characters)
# `name` or `name:split` of a named set, or a path to a .txt / .jsonl file (under the allowed roots).
DatasetSpec = Annotated[str, StringConstraints(min_length=1, max_length=1024, strip_whitespace=True), Printable]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64), Printable]
MetadataValue = Annotated[str, StringConstraints(max_length=512), Printable]

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")
# Job ids are uuid4 hex; the pattern keeps anything else (a NUL, a megabyte) away from the database.
JOB_ID_PATTERN = r"^[0-9a-f]{1,32}$"
JobIdText = Annotated[str, StringConstraints(pattern=JOB_ID_PATTERN)]
JobId = Annotated[str, PathParam(pattern=JOB_ID_PATTERN, description="the job's id")]
MAX_EVENT_ID = 2**63 - 1  # a BIGINT
MAX_SEED = 2**32 - 1


class Strict(BaseModel):
    # Unknown fields are an error rather than silently ignored: a typo must not run a different job.
    # NaN and infinity are refused: no setting means anything with them (and JSON cannot carry them back).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CalibrationIn(Strict):
    dataset: DatasetSpec = "wikitext2"
    n_samples: int = Field(128, ge=1, le=100_000)
    seq_len: int = Field(2048, ge=2, le=1_000_000)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    mode: Literal[CALIBRATION_MODES] = "sequential"  # type: ignore[valid-type]


class EvaluationIn(Strict):
    perplexity: list[DatasetSpec] = Field(default_factory=lambda: ["wikitext2", "ptb"], max_length=16)
    seq_len: int | None = Field(None, ge=2, le=1_000_000)
    zero_shot: list[Literal[ZERO_SHOT_TASKS]] = Field(default_factory=list)  # type: ignore[valid-type]
    limit: int | None = Field(None, ge=1, le=1_000_000)


class JobCreate(Strict):
    model: Annotated[str, Printable] = Field(
        min_length=1, max_length=1024, description="Hugging Face id `org/name` or an absolute local path"
    )
    revision: Annotated[str, Printable] | None = Field(None, min_length=1, max_length=200)
    ratio: float = Field(gt=0, lt=1)
    alpha: float = Field(1.0, ge=0, le=100)
    solver: Literal[SOLVERS] = "greedy"  # type: ignore[valid-type]
    allocation: Literal[ALLOCATIONS] = "gradient"  # type: ignore[valid-type]
    compensation: Literal[COMPENSATIONS] = Field(  # type: ignore[valid-type]
        "least_squares",
        description="least_squares: refit the kept units of o_proj/down_proj from the statistics; "
        "least_squares_dense_target: towards the dense model's output (sequential calibration)",
    )
    compensation_damping: float = Field(0.01, gt=0, le=1, description="x the mean diagonal of C over kept units")
    device: Literal[DEVICES] | None = Field(  # type: ignore[valid-type]
        None,
        description="which worker queue runs the job; default: the server's CASP_DEFAULT_DEVICE, whose default"
        " `auto` is the device of the machine that runs the job",
    )
    calibration: CalibrationIn = Field(default_factory=CalibrationIn)
    evaluation: EvaluationIn = Field(default_factory=EvaluationIn)
    export: list[Literal[EXPORT_FORMATS]] = Field(  # type: ignore[valid-type]
        default_factory=list, max_length=1, description="gguf: also a model-<gguf_type>.gguf artifact for llama.cpp"
    )
    gguf_type: Literal[GGUF_TYPES] = "f16"  # type: ignore[valid-type]
    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=16)

    @field_validator("model")
    @classmethod
    def _model_shape(cls, value: str) -> str:
        if value.startswith("/") or HUB_ID.match(value):
            return value
        if is_local_reference(value):
            raise ValueError("local paths must be absolute")
        raise ValueError("must be a Hugging Face id `org/name` or an absolute local path")


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


class JobList(BaseModel):
    data: list[JobOut]
    has_more: bool


class EventOut(BaseModel):
    id: int
    attempt: int
    kind: str
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
