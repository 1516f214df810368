"""Where the model's weights live while it is pruned: the whole model on the device (resident), or one decoder layer
at a time with the rest on the CPU (offload), chosen from a per-layer model of the device memory each stage needs.

The memory model works from the checkpoint's shapes alone (`ModelShape`), so it can be evaluated for a model this
machine could never load (bench/device_memory.py: Llama-2-70B). It counts, for one decoder layer:

- its weights, in the model's dtype;
- one batch's activations through it (hidden states, q/k/v, attention output, the MLP's gate, up and product), and,
  where attention is eager, the score matrix in float32 and again in the dtype;
- the statistics C of the o_proj and down_proj inputs (float64 up to a width of 4096, float32 above), the
  float64/float32 copy of one batch's rows they are accumulated from, and Q beside C; compensation's C_kk and its
  Cholesky factor in float64 (a dense-mode sweep's shared refit holds the factor of the whole C and two float64
  out x width matrices instead, about as much: not counted apart); towards the dense target, the cross-moments M
  and C_d too;
- allocation's gradient: the layer's forward recomputed with grad (its activations again) and dJ/dX, dJ/dZ;
- verification's float64 copies of the masked and the pruned layer (at most two dense layers' worth);
- alpha "auto": the copies of o_proj and down_proj that each candidate restores.

A mixture of experts (`ModelShape.experts` > 0, `intermediate` then one expert's width) holds all its experts'
weights and the router's; one batch's activations through one expert at a time (the eager loop: at most every token
of the batch in one expert) and the router's logits; and the statistics of one expert only (C_e, Q_e, C_kk and its
factor, at the expert's width), never two experts' at once (casp_core.method.experts); no attention statistics (heads
stay).

The head's stage (final norm and head) holds the head and one chunk of tokens' logits in float32 with their
log-softmax and gradient (casp_core.method.next_token: at most `LOGITS_CHUNK_BYTES` of logits); the embedding's holds
the embedding and one batch's hidden states.
Resident, the device holds the whole model plus the largest stage's working set; offloaded, the largest of one
layer's stage, the head's and the embedding's. The figures are upper bounds (each stage's tensors counted as if all
alive at once), not yet checked against a GPU measurement.

Recovery (`estimate_recovery_memory`) holds the whole pruned model on the device: its weights (the decoder layers
shrunk by the ratio; float32 unless bf16 autocast runs the matmuls); what trains with its gradient and AdamW's two
moments in float32 (LoRA's adapters, at the dense widths as a bound, a mixture's on every expert, or with `full`
every decoder weight); one batch's activations (what autograd keeps of a layer for the backward pass,
`kept_per_token`, checked against each family's layer by tests/core/recovery/test_recovery_memory.py; with gradient
checkpointing each layer's input plus one layer's recomputed, without it every layer's), and the float32
logits of one chunk of the batch's positions several times over (logits, log-softmax and gradient; distillation adds
the tempered log-softmax and the top-k's rest): the loss takes the logits a chunk at a time, recomputed in the
backward pass (casp_core.method.next_token).
"""

from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from casp_core.errors import DeviceMemoryTooSmall
from casp_core.families import family_of
from casp_core.method.calibration import FLOAT64_MAX_DIM
from casp_core.method.next_token import tokens_per_chunk
from casp_core.run import CPU
from casp_core.settings import (
    AUTO_ALPHA,
    CROSS_ENTROPY_LOSS,
    DENSE_TARGET_COMPENSATION,
    FULL_RECOVERY,
    PruneConfig,
    RecoveryConfig,
)

RESIDENT, OFFLOAD = "resident", "offload"
FLOAT32, FLOAT64 = 4, 8
GIB = 2**30
# Bytes per trained parameter beyond its float32 weight: its gradient and AdamW's two moments.
OPTIMIZER_STATE = 3 * FLOAT32
# Float32 copies of a chunk's logits alive at once: logits, log-softmax, gradient; distillation's tempered
# log-softmax, the copy with the top k masked for the rest bucket and its gradient.
CROSS_ENTROPY_LOGITS, DISTILLATION_LOGITS = 3, 6


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of a LLaMA-family checkpoint's config."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied_head: bool
    dtype_bytes: int
    eager_attention: bool  # the score matrix is materialised (sdpa and flash attention do not keep it)
    experts: int = 0  # a mixture of experts: its experts per layer (`intermediate` is then one expert's width)
    shared_expert: int = 0  # the width of a mixture of experts' shared expert (Qwen2-MoE), 0 where there is none
    experts_per_token: int = 0  # a mixture of experts: the routed experts each token goes through (top-k)
    hidden_norms: int = 2  # the norms of the hidden states in a layer (Gemma's four)
    qk_norms: bool = False  # q and k normed (Qwen3, OLMo 2)

    @classmethod
    def of(cls, model: PreTrainedModel) -> "ModelShape":
        eager = getattr(model.config, "_attn_implementation", "eager") == "eager"
        return cls.from_config(model.config, dtype_bytes=model.dtype.itemsize, eager_attention=eager)

    @classmethod
    def from_config(cls, model_config: PretrainedConfig, *, dtype_bytes: int, eager_attention: bool) -> "ModelShape":
        """A checkpoint's shapes without its weights (bench/device_memory.py: models this machine cannot load)."""
        heads = model_config.num_attention_heads
        family = family_of(model_config)
        experts = family.num_experts(model_config) if family.has_experts else 0
        return cls(
            hidden=model_config.hidden_size,
            intermediate=family.expert_width(model_config) if experts else model_config.intermediate_size,
            heads=heads,
            kv_heads=getattr(model_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(model_config, "head_dim", None) or model_config.hidden_size // heads,
            layers=model_config.num_hidden_layers,
            vocab=model_config.vocab_size,
            tied_head=bool(model_config.tie_word_embeddings),
            dtype_bytes=dtype_bytes,
            eager_attention=eager_attention,
            experts=experts,
            shared_expert=family.shared_expert_width(model_config) if family.has_experts else 0,
            experts_per_token=model_config.num_experts_per_tok if family.has_experts else 0,
            hidden_norms=family.hidden_norms,
            qk_norms=family.qk_norms,
        )

    def layer_parameters(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        if self.experts:  # every expert's gate, up and down, and the router; a shared expert and its gate
            shared = 3 * self.shared_expert + 1 if self.shared_expert else 0
            return attention + (self.experts * (3 * self.intermediate + 1) + shared) * self.hidden + 2 * self.hidden
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def ffn_adapter_width(self) -> int:
        """The rows plus columns of the FFN weights LoRA adapts in a layer (rank x that many adapter weights): a
        dense MLP's gate, up and down; each expert's fused gate_up and its down, and a shared expert's three."""
        if self.experts:
            shared = 3 * (self.hidden + self.shared_expert) if self.shared_expert else 0
            return self.experts * (3 * self.intermediate + 2 * self.hidden) + shared
        return 3 * (self.hidden + self.intermediate)

    def ffn_width_per_token(self) -> int:
        """The FFN channels one token's forward computes: the MLP's, or those of its top-k experts and a shared one."""
        if self.experts:
            return self.experts_per_token * self.intermediate + self.shared_expert
        return self.intermediate

    def model_parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied_head else 2)
        return self.layers * self.layer_parameters() + embeddings + self.hidden


@dataclass(frozen=True)
class JobShape:
    """What the memory model needs of the job: one batch's tokens and the stages it runs."""

    batch_size: int
    seq_len: int
    gradient_allocation: bool
    alpha_auto: bool
    dense_target: bool

    @classmethod
    def of(cls, settings: PruneConfig, model_config: PretrainedConfig) -> "JobShape":
        calibration = settings.calibration
        return cls(
            batch_size=min(calibration.batch_size, calibration.n_samples),
            seq_len=min(calibration.seq_len, model_config.max_position_embeddings),
            gradient_allocation=settings.allocation == "gradient" and settings.shape != "uniform",
            alpha_auto=settings.alpha == AUTO_ALPHA,
            dense_target=settings.compensation == DENSE_TARGET_COMPENSATION and calibration.mode == "sequential",
        )


@dataclass(frozen=True)
class PlacementPlan:
    """Where the weights are asked to be while layers are pruned, within which limit, and the job's shape the memory
    model reads."""

    device: str  # "auto" (cuda when available, else cpu), "cpu", "cuda:1", ...
    mode: str  # "auto" | "resident" | "offload"
    max_device_memory: int | None  # None: what the device has free
    job: JobShape

    @classmethod
    def of(cls, settings: PruneConfig, model_config: PretrainedConfig) -> "PlacementPlan":
        return cls(settings.device, settings.placement, settings.max_device_memory, JobShape.of(settings, model_config))


@dataclass(frozen=True)
class DeviceMemoryEstimate:
    """Bytes on the device: weights and each stage's working set beyond them, and the peaks of the two modes."""

    model_weights: int
    layer_weights: int
    layer_working_set: int  # the largest stage of one layer: statistics, solver, compensation, allocation, ...
    head_stage: int  # final norm, head and one chunk of logits (allocation, alpha "auto"), weights included
    embedding_stage: int  # embedding and one batch's hidden states, weights included
    resident_peak: int
    offload_peak: int

    def summary(self) -> dict[str, int]:
        return asdict(self)


def estimate_device_memory(shape: ModelShape, job: JobShape) -> DeviceMemoryEstimate:
    """The device memory of pruning a model of `shape` in each mode (the module docstring says what is counted)."""
    s, tokens = shape.dtype_bytes, job.batch_size * job.seq_len
    attn_width, ffn = shape.heads * shape.head_dim, shape.intermediate
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    activations = tokens * (3 * shape.hidden + qkv + attn_width + 3 * ffn) * s
    if shape.experts:  # the router's logits, and one expert's output beside the block's sum
        activations += tokens * (shape.experts + shape.hidden) * s
    if shape.eager_attention:
        activations += job.batch_size * shape.heads * job.seq_len**2 * (FLOAT32 + s)

    def statistics_bytes(width: int) -> int:
        size = FLOAT64 if width <= FLOAT64_MAX_DIM else FLOAT32
        matrices = 2 + (2 if job.dense_target else 0)  # C and Q; M and C_d towards the dense target
        return matrices * width * width * size + tokens * width * size * (2 if job.dense_target else 1)

    # A mixture of experts measures one expert at a time and no attention (its heads stay).
    if shape.experts:
        ffn = max(ffn, shape.shared_expert)  # the widest expert's statistics, one expert at a time
    statistics = sum(statistics_bytes(width) for width in ((ffn,) if shape.experts else (attn_width, ffn)))
    compensation = 2 * ffn * ffn * FLOAT64  # C_kk and its factor, at most the whole width kept
    pruning_stage = activations + statistics + compensation
    if job.alpha_auto:
        pruning_stage += 2 * shape.hidden * (attn_width + ffn) * s
    gradient_stage = 2 * activations + 2 * tokens * shape.hidden * s if job.gradient_allocation else 0
    layer_weights = shape.layer_parameters() * s
    verification_stage = 2 * shape.layer_parameters() * FLOAT64 - layer_weights  # beyond the layer's own weights
    layer_working_set = max(pruning_stage, gradient_stage, verification_stage)

    # One chunk of tokens' logits at a time (allocation and alpha "auto" take the loss through
    # casp_core.method.next_token).
    chunk = min(tokens, tokens_per_chunk(shape.vocab))
    logits = 3 * chunk * shape.vocab * FLOAT32 if job.gradient_allocation or job.alpha_auto else 0
    head_stage = (shape.vocab + 1) * shape.hidden * s + logits + 2 * tokens * shape.hidden * s
    embedding_stage = shape.vocab * shape.hidden * s + tokens * shape.hidden * s
    model_weights = shape.model_parameters() * s
    return DeviceMemoryEstimate(
        model_weights=model_weights,
        layer_weights=layer_weights,
        layer_working_set=layer_working_set,
        head_stage=head_stage,
        embedding_stage=embedding_stage,
        resident_peak=model_weights + max(layer_working_set, logits + 2 * tokens * shape.hidden * s),
        offload_peak=max(layer_weights + layer_working_set, head_stage, embedding_stage),
    )


@dataclass(frozen=True)
class Placement:
    """Layers run on `device`; between uses their weights rest at `home`: the device itself (resident) or the CPU
    (offload). Activations wait on the CPU between layers either way."""

    mode: str
    device: torch.device
    home: torch.device
    limit: int | None  # the bytes the job may use on the device; None where nothing says (the CPU, an unknown device)
    estimate: DeviceMemoryEstimate

    def message(self) -> str:
        where = f"{self.device}" + (f", {byte_size(self.limit)} allowed" if self.limit is not None else "")
        if self.device == CPU:
            return f"the CPU holds the model ({byte_size(self.estimate.model_weights)} of weights)"
        if self.mode == RESIDENT:
            peak = byte_size(self.estimate.resident_peak)
            return f"resident, the whole model on {where} (estimated peak {peak})"
        return (
            f"offload, one decoder layer at a time on {where} (estimated peak "
            f"{byte_size(self.estimate.offload_peak)}; resident would need {byte_size(self.estimate.resident_peak)})"
        )

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "device": str(self.device), "limit_bytes": self.limit, **self.estimate.summary()}


def bf16_autocast(device: torch.device) -> bool:
    """Whether recovery runs its matmuls under bf16 autocast there (the weights then stay in the model's dtype)."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


@dataclass(frozen=True)
class RecoveryMemoryEstimate:
    """Bytes on the device while recovery trains: the pruned weights, what trains with its optimizer state, one
    batch's activations, its logits, and their sum."""

    weights: int
    optimizer_state: int
    activations: int
    logits: int

    @property
    def peak(self) -> int:
        return self.weights + self.optimizer_state + self.activations + self.logits

    def summary(self) -> dict[str, int]:
        return {**asdict(self), "peak": self.peak}

    def parts(self) -> str:
        return (
            f"{byte_size(self.weights)} of weights, {byte_size(self.optimizer_state)} of optimizer state, "
            f"{byte_size(self.activations)} of activations, {byte_size(self.logits)} of logits"
        )


def estimate_recovery_memory(
    shape: ModelShape, recovery: RecoveryConfig, ratio: float, *, autocast: bool
) -> RecoveryMemoryEstimate:
    """The device memory of recovering `shape` pruned by `ratio` as `recovery` says (the module docstring says
    what is counted); `autocast`: bf16 autocast (`bf16_autocast`), else everything in float32."""
    weight_bytes = shape.dtype_bytes if autocast else FLOAT32
    activation_bytes = 2 if autocast else FLOAT32
    decoder = int(shape.layers * shape.layer_parameters() * (1 - ratio))
    rest = shape.model_parameters() - shape.layers * shape.layer_parameters()
    tokens = recovery.batch_size * recovery.max_seq_len
    attn_width = shape.heads * shape.head_dim
    if recovery.method == FULL_RECOVERY:
        weights = decoder * FLOAT32 + rest * weight_bytes  # the decoder layers train in float32
        optimizer_state = decoder * OPTIMIZER_STATE
    else:
        weights = (decoder + rest) * weight_bytes
        widths = [shape.hidden + attn_width, 2 * (shape.hidden + shape.kv_heads * shape.head_dim)]
        widths += [attn_width + shape.hidden, shape.ffn_adapter_width()]
        adapters = shape.layers * recovery.rank * sum(widths)
        optimizer_state = adapters * (FLOAT32 + OPTIMIZER_STATE)
    per_layer = tokens * kept_per_token(shape, recovery, activation_bytes)
    if shape.eager_attention:
        per_layer += recovery.batch_size * shape.heads * recovery.max_seq_len**2 * (FLOAT32 + activation_bytes)
    checkpointing = recovery.gradient_checkpointing or recovery.method == FULL_RECOVERY
    if checkpointing:
        activations = shape.layers * tokens * shape.hidden * activation_bytes + 2 * per_layer
    else:
        activations = shape.layers * per_layer + per_layer
    copies = CROSS_ENTROPY_LOGITS if recovery.loss == CROSS_ENTROPY_LOSS else DISTILLATION_LOGITS
    logits = min(tokens, tokens_per_chunk(shape.vocab)) * shape.vocab * FLOAT32 * copies
    return RecoveryMemoryEstimate(weights, optimizer_state, activations, logits)


def kept_per_token(shape: ModelShape, recovery: RecoveryConfig, activation_bytes: int) -> int:
    """The bytes of one token that one decoder layer's forward keeps for the backward pass, as autograd saves them
    (tests/core/recovery/test_recovery_memory.py counts them in each family's layer): each norm's input and output;
    q, and k and v repeated to every query head (sdpa takes them so), attention's output, its contiguous copy for
    o_proj, and its log-sum-exp; the MLP's gate, activation, up and product (a mixture's: of each routed expert,
    with the router's logits and each expert's gathered input and weighted output); LoRA's adapter outputs and,
    with dropout, each adapted projection's dropped-out input and mask."""
    attn_width, ffn = shape.heads * shape.head_dim, shape.ffn_width_per_token()
    values = 2 * shape.hidden_norms * shape.hidden + 5 * attn_width + shape.heads + 4 * ffn
    if shape.qk_norms:
        values += 2 * (attn_width + shape.kv_heads * shape.head_dim)
    if shape.experts:
        values += shape.experts + 2 * shape.experts_per_token * shape.hidden
    values += values // 10  # what some families keep beyond these: fused projections' outputs, the routing's
    if recovery.method == FULL_RECOVERY:
        return values * activation_bytes
    targets = set(recovery.target_modules)
    values += recovery.rank * len(targets)
    # peft cannot drop out the experts' adapters, which are on their weights, and then drops out none.
    ffn_adapted = bool(targets & {"gate_proj", "up_proj", "down_proj"})
    if not recovery.dropout or (shape.experts and ffn_adapted):
        return values * activation_bytes
    inputs = {"o_proj": attn_width, "down_proj": ffn}
    dropped = sum(inputs.get(target, shape.hidden) for target in targets)
    return values * activation_bytes + dropped * (activation_bytes + 1)  # the copy, and its mask of one byte


def check_recovery_fits(
    model: PreTrainedModel, recovery: RecoveryConfig, ratio: float, placement: PlacementPlan, device: torch.device
) -> RecoveryMemoryEstimate:
    """Recovery's estimate for `model` pruned at `ratio`; refused (`DeviceMemoryTooSmall`) when it exceeds the limit
    (the placement's `max_device_memory`, else what the device has free; none on the CPU), with what would fit
    instead."""
    shape, autocast = ModelShape.of(model), bf16_autocast(device)

    def estimate(changes: dict[str, Any]) -> RecoveryMemoryEstimate:
        changed = RecoveryConfig.model_validate({**recovery.model_dump(), **changes})
        return estimate_recovery_memory(shape, changed, ratio, autocast=autocast)

    needed = estimate({})
    limit = None if device == CPU else placement.max_device_memory or device_free_memory(device)
    if limit is None or needed.peak <= limit:
        return needed
    alternatives = []
    if recovery.method == FULL_RECOVERY and estimate({"method": "lora"}).peak <= limit:
        alternatives.append(f"method lora ({byte_size(estimate({'method': 'lora'}).peak)})")
    if not recovery.gradient_checkpointing and recovery.method != FULL_RECOVERY:
        checkpointed = estimate({"gradient_checkpointing": True})
        if checkpointed.peak <= limit:
            alternatives.append(f"gradient_checkpointing ({byte_size(checkpointed.peak)})")
    # Halved until it fits; a smaller batch with a larger grad_accum keeps the optimizer step the same.
    for name, least in (("max_seq_len", 2), ("batch_size", 1)):
        value = getattr(recovery, name) // 2
        while value >= least and estimate({name: value}).peak > limit:
            value //= 2
        if value >= least:
            alternatives.append(f"{name} {value} ({byte_size(estimate({name: value}).peak)})")
    fits = (
        "; would fit: " + ", ".join(alternatives)
        if alternatives
        else "; no shorter sequence, smaller batch or lora fits"
    )
    raise DeviceMemoryTooSmall(
        f"max_device_memory: {byte_size(limit)} on {device} is less than the estimated {byte_size(needed.peak)} "
        f"recovery needs ({needed.parts()}){fits}"
    )


def byte_size(count: int) -> str:
    """As people read it: GiB from 1 GiB up, MiB below."""
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2**20:.1f} MiB"


def device_free_memory(device: torch.device) -> int | None:
    """What the device has free now, where it can say (CUDA), counting what torch's allocator holds in reserve for
    this process as free; None elsewhere."""
    if device.type == "cuda":
        return (
            torch.cuda.mem_get_info(device)[0]
            + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device)
        )
    return None


def choose_placement(model: PreTrainedModel, plan: PlacementPlan, device: torch.device) -> Placement:
    """The job's placement on `device` (`plan.device` resolved): `plan.mode`, or for `auto` resident when the
    estimated resident peak fits within the limit (`plan.max_device_memory`, else what the device has free) and
    offload when it does not or no limit is known. On the CPU the model stays where it is. A mode whose peak exceeds
    a known limit is refused before any work (`DeviceMemoryTooSmall`)."""
    estimate = estimate_device_memory(ModelShape.of(model), plan.job)
    if device == CPU:
        return Placement(RESIDENT, device, CPU, None, estimate)
    limit = plan.max_device_memory or device_free_memory(device)
    mode = plan.mode
    if mode == "auto":
        mode = RESIDENT if limit is not None and estimate.resident_peak <= limit else OFFLOAD
    peak = estimate.resident_peak if mode == RESIDENT else estimate.offload_peak
    if limit is not None and peak > limit:
        if mode == RESIDENT:
            why = f"with the whole model resident (offloaded: {byte_size(estimate.offload_peak)})"
        else:
            why = (
                f"with one decoder layer at a time ({byte_size(estimate.layer_weights)} of weights, "
                f"{byte_size(estimate.layer_working_set)} of working set, the head's stage "
                f"{byte_size(estimate.head_stage)}); a smaller calibration.batch_size or seq_len needs less"
            )
        raise DeviceMemoryTooSmall(
            f"max_device_memory: {byte_size(limit)} on {device} is less than the estimated {byte_size(peak)} "
            f"pruning needs {why}"
        )
    return Placement(mode, device, device if mode == RESIDENT else CPU, limit, estimate)
