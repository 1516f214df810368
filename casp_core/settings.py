"""Settings of a pruning run: the one source of every setting's name, type, default, range and description.

The command line (`casp prune`, `casp submit`), the API's request schema (POST /v1/jobs) and the README's table of
settings are all built from these models (defaults follow the paper and docs/method-notes.md). `PruneSettings` is
what the user chooses; `PruneConfig` adds what the machine that runs the job decides (`SERVER_SIDE`).
"""

import re
from collections.abc import Iterator
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from casp_core.errors import InvalidConfig

SOLVERS = ("greedy", "diagonal", "relaxation", "greedy_refine", "wanda_sp", "flap", "greedy_compensated")
ALLOCATIONS = ("gradient", "uniform")
# per_layer: each layer keeps its own heads and FFN width (CaspLlamaForCausalLM, remote code); uniform: every layer
# keeps the same ones, saved as the source family's own class (LlamaForCausalLM, ...) for vLLM, TGI and llama.cpp.
SHAPES = ("per_layer", "uniform")
UNIFORM_SHAPE = "uniform"
CALIBRATION_MODES = ("sequential", "dense")
# least_squares fits the kept units to this layer's own output on the inputs it sees; with sequential calibration,
# least_squares_dense_target fits them to the dense model's output on the dense model's inputs (the same in dense
# calibration mode). bias is FLAP's: the removed inputs' mean contribution W_p E[y_p] goes into the output bias.
COMPENSATIONS = ("none", "least_squares", "least_squares_dense_target", "bias")
NO_COMPENSATION = "none"
DENSE_TARGET_COMPENSATION = "least_squares_dense_target"
MEAN_BIAS_COMPENSATION = "bias"
DTYPES = ("auto", "float32", "float16", "bfloat16")
EXPORT_FORMATS = ("gguf",)  # written beside the checkpoint by casp_core.artifacts.gguf.writer
# As llama.cpp spells them; the quantized ones are made by llama.cpp's own quantizer (casp_core.artifacts.gguf.types).
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q3_k_m", "q2_k")
GGUF_TYPES += ("q4_0", "q5_0", "iq4_nl")  # blocks of 32, as q8_0
# The checkpoint rewritten in compressed-tensors format for vLLM by casp_core.artifacts.compressed_tensors.quantize
# (round to nearest).
NO_QUANTIZATION = "none"
QUANTIZATIONS = (NO_QUANTIZATION, "w8a8_int8", "fp8_dynamic", "w4a16")
# auto: the whole model on the device when casp_core.method.placement's estimate fits within max_device_memory, else one
# decoder layer at a time; on the CPU nothing is ever offloaded.
PLACEMENTS = ("auto", "resident", "offload")
# lora: adapters on the projections, merged after training; full: every kept weight of the decoder layers trained.
NO_RECOVERY = "none"
RECOVERY_METHODS = (NO_RECOVERY, "lora", "full")
FULL_RECOVERY = "full"
# The adapters' own settings: with method full there are no adapters, so setting one is a mistake worth naming.
LORA_ONLY_SETTINGS = ("rank", "alpha", "dropout", "target_modules")
# cross_entropy: next-token loss on the data; distill: KL divergence from the dense model's next-token distribution
# (its top-k, cached before pruning: casp_core.recovery.teacher); distill_ce: a weighted sum of the two.
RECOVERY_LOSSES = ("cross_entropy", "distill", "distill_ce")
CROSS_ENTROPY_LOSS = "cross_entropy"
MAX_TEACHER_TOP_K = 4096
# The linear layers LoRA may adapt: every projection of a decoder layer, whatever its width after pruning.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A sweep (`target` given) prunes at each of `ratios` and writes each in each of its format's variants.
TARGET_FORMATS = ("gguf", "safetensors")
DEFAULT_TARGET_FORMAT = "gguf"
DEFAULT_SWEEP_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
KEEP_CHOICES = ("best", "all")
# all: the dense model in each variant may be the pick ("just quantize"); pruned: only a pruned candidate may.
TARGET_CANDIDATES = ("all", "pruned")
MAX_SWEEP_RATIOS = 32
BUDGETS = ("max_bytes", "max_params", "max_perplexity_increase")
MAX_PERPLEXITY_INCREASE = 100
ZERO_SHOT_TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
# Settings the machine that runs the job decides: on the service they are the server's, never the caller's.
SERVER_SIDE = ("datasets_dir", "device")
MAX_SEED = 2**32 - 1
MAX_SEQ_LEN = 1_000_000
MAX_ROUND_TO = 65_536
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")


def _no_control_characters(value: str) -> str:
    # A NUL cannot even be stored by PostgreSQL or put in a path; none of these belongs in a name.
    if CONTROL_CHARACTERS.search(value):
        raise ValueError("must not contain control characters")
    return value


Printable = AfterValidator(_no_control_characters)
# `name` or `name:split` of a named set, or a path to a .txt / .jsonl file.
DatasetSpec = Annotated[str, StringConstraints(min_length=1, max_length=1024, strip_whitespace=True), Printable]


BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
BYTE_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
BYTE_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
BYTE_SIZE_RULE = "must be a number of bytes > 0, or one with a unit such as 24GiB or 500MB"


def _byte_count(value: Any) -> Any:
    """`24GiB`, `500MB`, `1.5 GB` or a plain number, as a whole number of bytes (anything else is left for the
    int check to refuse, with the rule in `BYTE_SIZE_RULE`)."""
    if isinstance(value, str):
        match = BYTE_SIZE.fullmatch(value)
        if match and match[2].lower() in BYTE_UNITS:
            return int(float(match[1]) * BYTE_UNITS[match[2].lower()])
    return value


# alpha "auto": the temperature with the lowest held-out loss among a few (casp_core.method.temperature).
AUTO_ALPHA = "auto"
# Not the paper's 1: on SmolLM2-135M, 0.5 beats it on WikiText-2 and PTB at 0.1, 0.2, 0.3 and 0.5 but one column
# (bench/results/smollm2.md); a cooler temperature spreads the ratio more evenly over the layers.
DEFAULT_ALPHA = 0.5
MAX_ALPHA = 100
AUTO_ALPHA_NEEDS_WINDOWS = 'alpha: "auto" holds out calibration windows to score temperatures: needs n_samples >= 2'


def fixed_alpha(alpha: float | str) -> float:
    """alpha as a number where auto's scoring does not reach (a size estimate, the experts' split within a layer):
    the default stands in for auto."""
    return DEFAULT_ALPHA if alpha == AUTO_ALPHA else float(alpha)


def _one_reason(reason: str) -> WrapValidator:
    """A union reports one error per member (`round_to.constrained-int: ...; round_to.literal['auto']: ...`);
    the user needs one line that names the setting and everything it takes."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("keyword_or_number", f"{reason}, got {{value}}", {"value": value}) from None

    return WrapValidator(validate)


Alpha = Annotated[
    Annotated[float, Field(ge=0, le=MAX_ALPHA)] | Literal[AUTO_ALPHA],  # type: ignore[valid-type]
    _one_reason(f'must be a number in [0, {MAX_ALPHA}] or "{AUTO_ALPHA}"'),
]
ByteCount = Annotated[int, annotated_types.Ge(1), BeforeValidator(_byte_count), _one_reason(BYTE_SIZE_RULE)]
# `auto` (casp_core.rounding chooses per layer width) or an explicit multiple.
RoundTo = Annotated[
    Annotated[int, annotated_types.Ge(1), annotated_types.Le(MAX_ROUND_TO)] | Literal["auto"],
    _one_reason(f"must be auto or an integer in [1, {MAX_ROUND_TO}]"),
]


class ConfigPart(BaseModel):
    """Unknown fields are an error rather than silently ignored: a typo must not run a different job. NaN and
    infinity are refused: no setting means anything with them (and JSON cannot carry them back). A bad value
    raises InvalidConfig naming the field (`calibration.n_samples: ...`) from `from_dict` (and from PruneConfig's
    construction)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise invalid_config(cls, error) from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _number_rules(info: FieldInfo) -> list[Any]:
    """The setting's own rules, and those of the number in a union such as `int | "auto"` or in a list."""
    members = get_args(info.annotation) if get_origin(info.annotation) in (Union, UnionType, list) else ()
    return [
        *info.metadata,
        *(rule for member in members if get_origin(member) is Annotated for rule in member.__metadata__),
    ]


def describe_range(info: FieldInfo) -> str:
    """A number setting's bounds as people write them: `in (0, 1)`, `in [1, 100000]`, `>= 0`; '' without any."""
    low = high = None
    for rule in _number_rules(info):
        if isinstance(rule, annotated_types.Gt | annotated_types.Ge):
            low = ("(" if isinstance(rule, annotated_types.Gt) else "[", getattr(rule, "gt", getattr(rule, "ge", 0)))
        elif isinstance(rule, annotated_types.Lt | annotated_types.Le):
            high = (")" if isinstance(rule, annotated_types.Lt) else "]", getattr(rule, "lt", getattr(rule, "le", 0)))
    if low and high:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"{'>' if low[0] == '(' else '>='} {low[1]}"
    if high:
        return f"{'<' if high[0] == ')' else '<='} {high[1]}"
    return ""


def reason(info: FieldInfo | None, error_type: str, value: Any, message: str) -> str:
    """The rule a bad value broke, in the command line's words: the field's whole range or its choices."""
    if info is not None and error_type in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"must be {describe_range(info)}, got {value}"
    if info is not None and error_type == "too_short":
        least = next(rule.min_length for rule in info.metadata if isinstance(rule, annotated_types.MinLen))
        return "must not be empty" if least == 1 else f"must have at least {least} items"
    choices = choices_of(info.annotation) if info is not None else None
    if choices and error_type == "literal_error":
        return f"must be one of {', '.join(map(str, choices))}, got {value!r}"
    return message


def invalid_config(model: type[BaseModel], error: ValidationError) -> InvalidConfig:
    """The first error, as `field.sub: reason`: the command line prints it, the API points its 422 at the field."""
    first = error.errors()[0]
    name = ".".join(str(part) for part in first["loc"])
    fields = dict(setting_fields(model))
    # `evaluation.zero_shot.0` is an item of the list `evaluation.zero_shot`.
    info = fields.get(name) or fields.get(name.rpartition(".")[0])
    text = reason(info, first["type"], first.get("input"), first["msg"])
    return InvalidConfig(f"{name}: {text}" if name else text)


class CalibrationConfig(ConfigPart):
    dataset: DatasetSpec = Field(
        "wikitext2", description="calibration texts: wikitext2, ptb or c4, optionally name:split, or a .txt/.jsonl file"
    )
    n_samples: int = Field(128, ge=1, le=100_000, description="calibration windows")
    seq_len: int = Field(2048, ge=2, le=MAX_SEQ_LEN, description="tokens per window, capped at the model's context")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="picks the windows")
    mode: Literal[CALIBRATION_MODES] = Field(  # type: ignore[valid-type]
        "sequential", description="sequential: each layer sees the pruned layers before it; dense: the dense model's"
    )
    batch_size: int = Field(8, ge=1, le=4096, description="windows per forward pass (calibration and perplexity)")


class EvaluationConfig(ConfigPart):
    perplexity: list[DatasetSpec] = Field(
        default_factory=lambda: ["wikitext2", "ptb"], max_length=16, description="perplexity data sets"
    )
    seq_len: int | None = Field(
        None, ge=2, le=MAX_SEQ_LEN, description="perplexity window; default min(2048, the model's context)"
    )
    zero_shot: list[Literal[ZERO_SHOT_TASKS]] = Field(  # type: ignore[valid-type]
        default_factory=list, description="zero-shot tasks (lm-evaluation-harness)"
    )
    limit: int | None = Field(
        None, ge=1, le=1_000_000, description="quick runs: examples per zero-shot task and windows per perplexity set"
    )
    efficiency: bool = Field(False, description="measure parameters, MACs and latency (sizes in `efficiency`)")


class EfficiencyConfig(ConfigPart):
    """The paper's efficiency appendix: MACs of one 128-token sequence, latency of a 32 x 128 prefill and of
    decoding 128 new tokens, each the median of 10 timed runs after 2 untimed ones."""

    macs_seq_len: int = Field(128, ge=1, le=MAX_SEQ_LEN, description="tokens of the sequence MACs are counted for")
    batch_size: int = Field(32, ge=1, le=4096, description="prompts per latency run")
    seq_len: int = Field(128, ge=1, le=MAX_SEQ_LEN, description="prompt tokens per latency run")
    new_tokens: int = Field(128, ge=1, le=MAX_SEQ_LEN, description="tokens generated per decode run")
    repeats: int = Field(10, ge=1, le=1000, description="timed runs per latency figure (the median is reported)")
    warmup: int = Field(2, ge=0, le=1000, description="untimed runs before them")


class RecoveryConfig(ConfigPart):
    """Fine-tuning after pruning (docs/recovery.md). Defaults: the paper's appendix (2 epochs, lr 1e-4, batch
    128) and LLM-Pruner's LoRA (rank 8, alpha 16, dropout 0.05, every projection, 256-token sequences)."""

    method: Literal[RECOVERY_METHODS] = Field(  # type: ignore[valid-type]
        "none",
        description="none; lora: train LoRA adapters after pruning and merge them into the weights; full: train "
        "every kept weight of the decoder layers (AdamW, gradient checkpointing)",
    )
    loss: Literal[RECOVERY_LOSSES] = Field(  # type: ignore[valid-type]
        CROSS_ENTROPY_LOSS,
        description="cross_entropy: next-token loss on the data; distill: KL divergence from the dense model's "
        "next-token distribution (top-k, cached before pruning); distill_ce: ce_weight x cross_entropy + "
        "(1 - ce_weight) x distill",
    )
    temperature: float = Field(1.0, gt=0, le=100, description="distillation temperature (both distributions)")
    ce_weight: float = Field(0.5, ge=0, le=1, description="distill_ce: the cross-entropy's share of the loss")
    teacher_top_k: int = Field(
        64,
        ge=1,
        le=MAX_TEACHER_TOP_K,
        description="distillation: the dense model's most likely tokens kept per position (the rest as one bucket)",
    )
    dataset: DatasetSpec = Field(
        "wikitext2",
        description="training data: wikitext2, ptb or c4 (train split unless name:split), a .txt file, or a "
        ".jsonl/.json file of text or Alpaca (instruction/input/output) records",
    )
    epochs: float = Field(2.0, gt=0, le=1000, description="passes over the training data")
    max_steps: int | None = Field(None, ge=1, le=10_000_000, description="optimizer steps; when set, epochs is unused")
    lr: float = Field(1e-4, gt=0, le=1, description="peak learning rate (AdamW, linear warm-up and decay)")
    batch_size: int = Field(8, ge=1, le=4096, description="sequences per forward pass")
    grad_accum: int = Field(16, ge=1, le=4096, description="forward passes per optimizer step (8 x 16 = 128)")
    max_seq_len: int = Field(256, ge=2, le=MAX_SEQ_LEN, description="tokens per training sequence")
    rank: int = Field(8, ge=1, le=4096, description="LoRA rank")
    alpha: float = Field(16.0, gt=0, le=100_000, description="LoRA scaling numerator (scale = alpha / rank)")
    dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout")
    target_modules: list[Literal[LORA_TARGETS]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        max_length=len(LORA_TARGETS),
        description="the projections that get adapters",
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="adapter initialisation, data order and dropout")
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass (memory); always on with method full"
    )
    save_every: int = Field(50, ge=1, le=10_000_000, description="optimizer steps between saves of training state")

    @property
    def enabled(self) -> bool:
        """Whether the job recovers the pruned model at all."""
        return self.method != NO_RECOVERY


class MoeConfig(ConfigPart):
    """Mixture-of-experts models only (Mixtral: docs/moe.md)."""

    prune_unreached: bool = Field(
        False,
        description="prune experts that no calibration token reaches too (their statistics are zero, so which of "
        "their channels go is arbitrary); by default they are reported and kept whole",
    )
    prune_experts: int = Field(
        0,
        ge=0,
        le=4096,
        description="whole experts removed from every layer (the same count in each), their router rows with them: "
        "those with the least output energy S_e on the calibration tokens, never a shared expert; at least top_k "
        "must remain",
    )


class TargetConfig(ConfigPart):
    """A budget instead of a ratio: the job prunes at each of `ratios`, writes each in each candidate format
    (`gguf_types` or `quantizations`), measures them, and hands back the best within the budget. Exactly one
    budget is given."""

    max_bytes: ByteCount | None = Field(
        None, description="the served file(s) at most this big: a number of bytes, or 6GB, 500MiB, ..."
    )
    format: Literal[TARGET_FORMATS] | None = Field(  # type: ignore[valid-type]
        None,
        description="what max_bytes measures (gguf when left out): gguf, one file per gguf_types; safetensors, "
        "the checkpoint's weights per quantizations",
    )
    max_params: int | None = Field(
        None, ge=1, description="at most this many parameters in the whole model (embedding and head included)"
    )
    max_perplexity_increase: float | None = Field(
        None,
        gt=0,
        le=MAX_PERPLEXITY_INCREASE,
        description="the smallest file whose perplexity on the first evaluation text rises by at most this "
        "fraction over the dense model's (0.1: 10 %)",
    )
    candidates: Literal[TARGET_CANDIDATES] = Field(  # type: ignore[valid-type]
        "all",
        description="what the pick is chosen among: all, the pruned candidates and the dense model in each variant "
        "(the dense q8_0 when it beats every pruned file within the budget); pruned, the pruned candidates only",
    )

    @field_validator("format")
    @classmethod
    def _format_with_bytes(cls, value: str | None, info: ValidationInfo) -> str | None:
        # It says what max_bytes counts, so it means nothing without it.
        if value is not None and info.data.get("max_bytes") is None:
            raise PydanticCustomError("format_without_bytes", "only goes with max_bytes")
        return value

    @model_validator(mode="after")
    def _one_budget(self) -> "TargetConfig":
        given = [name for name in BUDGETS if getattr(self, name) is not None]
        if len(given) != 1:
            raise PydanticCustomError(
                "one_budget",
                "give exactly one of {budgets}, got {given}",
                {"budgets": ", ".join(BUDGETS), "given": ", ".join(given) or "none"},
            )
        if self.max_bytes is not None and self.format is None:
            self.format = DEFAULT_TARGET_FORMAT
        return self


class PruneSettings(ConfigPart):
    """What the user chooses: settable with the same name, default and range on the command line and the API."""

    ratio: float | None = Field(
        None, gt=0, lt=1, description="fraction of decoder parameters to remove; give ratio or target"
    )
    target: TargetConfig | None = Field(
        None, description="prune to a budget instead of a ratio: the best of several ratios and formats"
    )
    ratios: list[Annotated[float, annotated_types.Gt(0), annotated_types.Lt(1)]] = Field(
        default_factory=lambda: list(DEFAULT_SWEEP_RATIOS),
        min_length=1,
        max_length=MAX_SWEEP_RATIOS,
        description="with target: the ratios tried",
    )
    gguf_types: list[Literal[GGUF_TYPES]] | None = Field(  # type: ignore[valid-type]
        None,
        min_length=1,
        max_length=len(GGUF_TYPES),
        description="with a GGUF target: the types tried; default f16, q8_0, q5_k_m, q4_k_m",
    )
    quantizations: list[Literal[QUANTIZATIONS]] | None = Field(  # type: ignore[valid-type]
        None,
        min_length=1,
        max_length=len(QUANTIZATIONS),
        description="with a safetensors target: the schemes tried; default none, w8a8_int8, w4a16 (those the "
        "model's widths take)",
    )
    keep: Literal[KEEP_CHOICES] = Field(  # type: ignore[valid-type]
        "best", description="with target: best keeps the pick's files only, all every candidate's (candidates/)"
    )

    @field_validator("ratios", "gguf_types", "quantizations")
    @classmethod
    def _no_repeats(cls, values: list[Any] | None) -> list[Any] | None:
        if values is not None and len(set(values)) < len(values):
            repeated = next(value for value in values if values.count(value) > 1)
            raise PydanticCustomError("repeated", "names {value} twice", {"value": repeated})
        return values

    alpha: Alpha = Field(
        DEFAULT_ALPHA, description="allocation temperature, or auto: the grid's best on held-out calibration windows"
    )
    solver: Literal[SOLVERS] = Field("greedy", description="per-layer unit selection")  # type: ignore[valid-type]
    allocation: Literal[ALLOCATIONS] = Field(  # type: ignore[valid-type]
        "gradient", description="per-layer ratios: from the sensitivities, or the same everywhere"
    )
    shape: Literal[SHAPES] = Field(  # type: ignore[valid-type]
        "per_layer",
        description="per_layer: each layer its own heads and FFN width (remote code); uniform: the same in every "
        "layer, a plain checkpoint of the source family's class (vLLM, TGI); allocation does not apply",
    )
    r_max: float = Field(0.9, gt=0, le=1, description="no layer loses more than this fraction (at least ratio)")
    round_to: RoundTo = Field(
        "auto",
        description="kept FFN channels rounded to a multiple; auto: per layer the largest power of two <= 64 and "
        "<= width / 64, 1 where that is below 8 (widths fast kernels need: bench/results/engines.md)",
    )
    compensation: Literal[COMPENSATIONS] = Field(  # type: ignore[valid-type]
        "least_squares",  # the default from bench/results/compensation.md
        description="least_squares: refit the kept units of o_proj/down_proj from the statistics; "
        "least_squares_dense_target: towards the dense model's output (sequential calibration); "
        "bias: FLAP's, the removed units' mean output added to the o_proj/down_proj bias",
    )
    compensation_damping: float = Field(
        0.01, gt=0, le=1, description="x the mean diagonal of C (the sub-layer's, all its units)"
    )
    dtype: Literal[DTYPES] = Field("auto", description="auto: the checkpoint's own dtype")  # type: ignore[valid-type]
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    efficiency: EfficiencyConfig = Field(default_factory=EfficiencyConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    moe: MoeConfig = Field(default_factory=MoeConfig)
    export: list[Literal[EXPORT_FORMATS]] = Field(  # type: ignore[valid-type]
        default_factory=list,
        max_length=len(EXPORT_FORMATS),
        description="also written into the checkpoint: gguf (model-<gguf_type>.gguf, for llama.cpp)",
    )
    gguf_type: Literal[GGUF_TYPES] = Field(  # type: ignore[valid-type]
        "f16",
        description="GGUF weight type; the quantized ones by llama.cpp's quantizer (needs casp[gguf]), with round_to "
        "auto fitting FFN widths to their block (256 for the k types, 32 for q8_0, q4_0, q5_0, iq4_nl)",
    )
    max_device_memory: ByteCount | None = Field(
        None,
        description="bytes pruning may use on the device (a number, or 24GiB, 500MB, ...); default: what the "
        "device has free",
    )
    placement: Literal[PLACEMENTS] = Field(  # type: ignore[valid-type]
        "auto",
        description="resident: the whole model on the device; offload: one decoder layer at a time, the rest on "
        "the CPU; auto: resident when the estimate fits within max_device_memory (docs/placement.md)",
    )
    quantization: Literal[QUANTIZATIONS] = Field(  # type: ignore[valid-type]
        "none",
        description="the checkpoint written in compressed-tensors format for vLLM, rounded to nearest: w8a8_int8: "
        "int8 weights per channel, int8 activations per token; fp8_dynamic: the same in FP8; w4a16: int4 weights "
        "in groups of 128 (64 or 32 where 128 does not divide the row), 16-bit activations (docs/serving.md)",
    )


class PruneConfig(PruneSettings):
    datasets_dir: str | None = Field(None, description="local copies of the named data sets")
    device: str = Field("auto", description="auto (cuda when available, else cpu), cpu, cuda, cuda:1, ...")

    # Only here, not in the parts: pydantic calls a custom __init__ for nested models too, and the API's schema
    # nests the parts, where a bad value must stay a ValidationError (a 422), not an InvalidConfig.
    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise invalid_config(PruneConfig, error) from None

    def validate(self) -> "PruneConfig":  # type: ignore[override]
        """Checks the settings again (they may have been changed since construction) and the rules between them."""
        checked = PruneConfig.from_dict(self.model_dump())
        if (checked.ratio is None) == (checked.target is None):
            raise InvalidConfig(
                "ratio: give ratio or target, not both" if checked.is_sweep else "ratio: give ratio or target"
            )
        if checked.is_sweep and not max(checked.ratios) <= checked.r_max:
            raise InvalidConfig(f"ratios: must be at most r_max ({checked.r_max}), got {max(checked.ratios)}")
        if checked.is_sweep and checked.recovery.enabled:
            raise InvalidConfig("recovery: a sweep (target) does not recover its candidates; give a ratio to recover")
        if checked.is_sweep and not checked.evaluation.perplexity:
            raise InvalidConfig("evaluation.perplexity: a sweep (target) picks by perplexity: give at least one text")
        if checked.ratio is not None and not checked.ratio <= checked.r_max:
            raise InvalidConfig(f"r_max: must be in [ratio, 1], got {checked.r_max}")
        if not checked.recovery.enabled and checked.recovery.loss != CROSS_ENTROPY_LOSS:
            raise InvalidConfig(
                f"recovery.loss: {checked.recovery.loss} trains the pruned model: give recovery.method lora or full"
            )
        if checked.recovery.method == FULL_RECOVERY:
            for name in LORA_ONLY_SETTINGS:
                if getattr(checked.recovery, name) != RecoveryConfig.model_fields[name].get_default(
                    call_default_factory=True
                ):
                    raise InvalidConfig(
                        f"recovery.{name}: a LoRA setting, unused by recovery.method full (which trains the weights "
                        "themselves): leave it out or give recovery.method lora"
                    )
        if checked.alpha == AUTO_ALPHA and checked.calibration.n_samples < 2:
            raise InvalidConfig(AUTO_ALPHA_NEEDS_WINDOWS)
        return self

    @property
    def exports_gguf(self) -> bool:
        """A GGUF file is written beside the checkpoint."""
        return "gguf" in self.export

    @property
    def is_sweep(self) -> bool:
        """A budget was given: the job tries several ratios and formats (casp_core.job.sweep.candidates)."""
        return self.target is not None

    @property
    def keeps_retry_state(self) -> bool:
        """A retry resumes from what an attempt kept (casp_core.job.steps.RetryState): with recovery, the pruned
        model and the training state; in a sweep, the candidates measured; with zero-shot tasks, the scores."""
        return self.recovery.enabled or self.is_sweep or bool(self.evaluation.zero_shot)

    def candidate_config(self, ratio: float, fmt: str, variant: str) -> "PruneConfig":
        """The single-ratio job of one candidate of a sweep: `ratio`, written as GGUF type `variant` (fmt
        "gguf": a GGUF export, checkpoint unquantized) or quantized with scheme `variant` (fmt "safetensors")."""
        return self.written_as(fmt, variant, ratio=ratio, target=None)

    def written_as(self, fmt: str, variant: str, **update: Any) -> "PruneConfig":
        """These settings (with `update`), written as GGUF type `variant` (fmt "gguf": a GGUF export, checkpoint
        unquantized) or quantized with scheme `variant` (fmt "safetensors"): a sweep's dense pick keeps its target."""
        chosen = {**self.model_dump(), **update}
        if fmt == "gguf":
            chosen |= {"export": ["gguf"], "gguf_type": variant, "quantization": "none"}
        else:
            chosen |= {"quantization": variant}
        return PruneConfig(**chosen)


def setting_fields(model: type[BaseModel] = PruneSettings, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted name, FieldInfo) of every setting, depth first, in declaration order; parts are walked, not named."""
    for name, info in model.model_fields.items():
        part = part_of(info.annotation)
        if part is not None:
            yield from setting_fields(part, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def part_of(annotation: Any) -> type[BaseModel] | None:
    """The part a field holds (`calibration`: CalibrationConfig; `target`, optional: TargetConfig); None for a
    setting."""
    part = without_none(annotation)
    return part if isinstance(part, type) and issubclass(part, BaseModel) else None


def is_optional(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, UnionType) and NoneType in get_args(annotation)


def without_none(annotation: Any) -> Any:
    """`X | None` is X; a union of several types keeps them all but None; anything else is itself."""
    if not is_optional(annotation):
        return annotation
    members = tuple(arg for arg in get_args(annotation) if arg is not NoneType)
    return members[0] if len(members) == 1 else Union[members]  # noqa: UP007 (a tuple of types)


def choices_of(annotation: Any) -> tuple[Any, ...] | None:
    """The allowed values of a Literal setting (or of a list of them, optional or not); None for the others."""
    annotation = without_none(annotation)
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    return get_args(annotation) if get_origin(annotation) is Literal else None
