"""Request and response bodies of the HTTP API."""

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from api.core.settings import DEVICES
from api.models import JOB_STATUSES
from casp_core.config import ALLOCATIONS, CALIBRATION_MODES, SOLVERS, ZERO_SHOT_TASKS

# `name` or `name:split` of a named set, or a path to a .txt / .jsonl file (under the allowed roots).
DatasetSpec = Annotated[str, StringConstraints(min_length=1, max_length=1024, strip_whitespace=True)]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$")


class Strict(BaseModel):
    # Unknown fields are an error rather than silently ignored: a typo must not run a different job.
    model_config = ConfigDict(extra="forbid")


class CalibrationIn(Strict):
    dataset: DatasetSpec = "wikitext2"
    n_samples: int = Field(128, ge=1, le=100_000)
    seq_len: int = Field(2048, ge=2, le=1_000_000)
    seed: int = 0
    mode: Literal[CALIBRATION_MODES] = "sequential"  # type: ignore[valid-type]


class EvaluationIn(Strict):
    perplexity: list[DatasetSpec] = Field(default_factory=lambda: ["wikitext2", "ptb"], max_length=16)
    seq_len: int | None = Field(None, ge=2, le=1_000_000)
    zero_shot: list[Literal[ZERO_SHOT_TASKS]] = Field(default_factory=list)  # type: ignore[valid-type]
    limit: int | None = Field(None, ge=1)


class JobCreate(Strict):
    model: str = Field(min_length=1, max_length=1024, description="Hugging Face id `org/name` or a local path")
    revision: str | None = Field(None, min_length=1, max_length=200)
    ratio: float = Field(gt=0, lt=1)
    alpha: float = Field(1.0, ge=0)
    solver: Literal[SOLVERS] = "greedy"  # type: ignore[valid-type]
    allocation: Literal[ALLOCATIONS] = "gradient"  # type: ignore[valid-type]
    device: Literal[DEVICES] | None = Field(  # type: ignore[valid-type]
        None, description="which worker queue runs the job; default: the server's CASP_DEFAULT_DEVICE"
    )
    calibration: CalibrationIn = Field(default_factory=CalibrationIn)
    evaluation: EvaluationIn = Field(default_factory=EvaluationIn)
    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=16)

    @field_validator("model")
    @classmethod
    def _model_shape(cls, value: str) -> str:
        if is_local_path(value) or HUB_ID.match(value):
            return value
        raise ValueError("must be a Hugging Face id `org/name` or an absolute local path")


def is_local_path(model: str) -> bool:
    """Only explicit paths are local: anything else is a hub id, so `org/name` never reads the disk."""
    return model.startswith(("/", "./", "../", "~"))


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
