"""Settings of a pruning run, as plain data (defaults follow the paper and docs/method-notes.md)."""

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from casp_core.errors import InvalidConfig

SOLVERS = ("greedy", "diagonal", "relaxation", "greedy_refine", "wanda_sp", "flap", "greedy_compensated")
ALLOCATIONS = ("gradient", "uniform")
CALIBRATION_MODES = ("sequential", "dense")
# least_squares fits the kept units to this layer's own output on the inputs it sees; with sequential calibration,
# least_squares_dense_target fits them to the dense model's output on the dense model's inputs (the same in dense
# calibration mode).
COMPENSATIONS = ("none", "least_squares", "least_squares_dense_target")
DENSE_TARGET_COMPENSATION = "least_squares_dense_target"
DTYPES = ("auto", "float32", "float16", "bfloat16")
EXPORT_FORMATS = ("gguf",)  # written beside the checkpoint by casp_core.export
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
ZERO_SHOT_TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")


@dataclass
class CalibrationConfig:
    # A named set (`wikitext2`, `ptb`, `c4`), optionally `name:split` (default split `train`),
    # or a path to a .txt / .jsonl file.
    dataset: str = "wikitext2"
    n_samples: int = 128
    seq_len: int = 2048  # capped at the model's context length
    seed: int = 0
    mode: Literal["sequential", "dense"] = "sequential"
    batch_size: int = 8


@dataclass
class EvaluationConfig:
    perplexity: list[str] = field(default_factory=lambda: ["wikitext2", "ptb"])
    seq_len: int | None = None  # None: min(2048, the model's context)
    zero_shot: list[str] = field(default_factory=list)
    limit: int | None = None  # quick runs: examples per zero-shot task and windows per perplexity set
    efficiency: bool = False


@dataclass
class PruneConfig:
    ratio: float
    alpha: float = 1.0
    solver: str = "greedy"
    allocation: str = "gradient"
    r_max: float = 0.9  # no layer loses more than this fraction of its units
    round_to: int = 1  # kept FFN channels rounded to a multiple of this (8, 64: faster kernels)
    # Refit the kept columns of o_proj / down_proj by least squares from the calibration statistics.
    compensation: str = "least_squares"  # the default from bench/results/compensation.md
    compensation_damping: float = 0.01  # x the mean diagonal of C over the kept units
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    datasets_dir: str | None = None  # local copies of the named data sets (layout of shared/fixtures/data)
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: the checkpoint's own dtype
    export: list[str] = field(default_factory=list)  # formats also written into the checkpoint: "gguf"
    gguf_type: str = "f16"

    def validate(self) -> "PruneConfig":
        checks = [
            (0.0 < self.ratio < 1.0, "ratio", f"must be in (0, 1), got {self.ratio}"),
            (self.alpha >= 0.0, "alpha", f"must be >= 0, got {self.alpha}"),
            (self.solver in SOLVERS, "solver", f"must be one of {', '.join(SOLVERS)}, got {self.solver!r}"),
            (
                self.allocation in ALLOCATIONS,
                "allocation",
                f"must be one of {', '.join(ALLOCATIONS)}, got {self.allocation!r}",
            ),
            (self.ratio <= self.r_max <= 1.0, "r_max", f"must be in [ratio, 1], got {self.r_max}"),
            (self.round_to >= 1, "round_to", f"must be >= 1, got {self.round_to}"),
            (
                self.compensation in COMPENSATIONS,
                "compensation",
                f"must be one of {', '.join(COMPENSATIONS)}, got {self.compensation!r}",
            ),
            (
                0.0 < self.compensation_damping <= 1.0,
                "compensation_damping",
                f"must be in (0, 1], got {self.compensation_damping}",
            ),
            (self.dtype in DTYPES, "dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
            (set(self.export) <= set(EXPORT_FORMATS), "export", f"formats must be among {', '.join(EXPORT_FORMATS)}"),
            (
                self.gguf_type in GGUF_TYPES,
                "gguf_type",
                f"must be one of {', '.join(GGUF_TYPES)}, got {self.gguf_type!r}",
            ),
            (self.calibration.n_samples >= 1, "calibration.n_samples", "must be >= 1"),
            (self.calibration.seq_len >= 2, "calibration.seq_len", "must be >= 2"),
            (self.calibration.batch_size >= 1, "calibration.batch_size", "must be >= 1"),
            (
                self.calibration.mode in CALIBRATION_MODES,
                "calibration.mode",
                f"must be one of {', '.join(CALIBRATION_MODES)}, got {self.calibration.mode!r}",
            ),
            (
                set(self.evaluation.zero_shot) <= set(ZERO_SHOT_TASKS),
                "evaluation.zero_shot",
                f"tasks must be among {', '.join(ZERO_SHOT_TASKS)}",
            ),
            (
                self.evaluation.limit is None or self.evaluation.limit >= 1,
                "evaluation.limit",
                "must be >= 1",
            ),
        ]
        for ok, name, reason in checks:
            if not ok:
                raise InvalidConfig(f"{name}: {reason}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PruneConfig":
        data = dict(data)
        calibration = CalibrationConfig(**data.pop("calibration", {}) or {})
        evaluation = EvaluationConfig(**data.pop("evaluation", {}) or {})
        return cls(calibration=calibration, evaluation=evaluation, **data)
