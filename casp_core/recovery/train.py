"""Recovery: fine-tuning of the pruned model (the paper's appendix, after LLM-Pruner; distillation after Minitron).

What is trained (`method`): `lora`, peft's adapters on the chosen projections of every decoder layer, whatever
their widths after pruning, the pruned weights frozen, the adapters merged at the end; or `full`, every weight of
the decoder layers (embedding, final norm and head frozen), in float32, with gradient checkpointing. Either way
torch's AdamW trains with a linear warm-up and decay (transformers' schedule), and the result is again a plain
pruned checkpoint of the same shapes.

The loss (`loss`), per labelled token of an optimizer step (all of a text window, an Alpaca record's output):
`cross_entropy`, the next-token cross-entropy; `distill`, the KL divergence from the dense teacher's next-token
distribution (its top k, cached before pruning: casp_core.recovery.teacher) to the student's, at `temperature`;
`distill_ce`, `ce_weight` x the first + (1 - `ce_weight`) x the second. The curve carries both terms whenever a
teacher is given.

Long runs: progress is reported per optimizer step (loss, tokens/s), cancellation is checked before every forward
pass, and with a `state_dir` the training state (adapters, optimizer, schedule, random state, curve) is written
there every `save_every` steps; a later call with the same directory, settings, data and model weights resumes from
the last save and ends with the same weights as an uninterrupted run.
"""

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_linear_schedule_with_warmup

from casp_core.errors import InvalidConfig
from casp_core.families import family_of
from casp_core.method.next_token import final_hidden_states, of_chunks
from casp_core.method.placement import bf16_autocast
from casp_core.model import decoder_layers, resolve_device, weights_digest
from casp_core.recovery.data import TrainingData, collate
from casp_core.recovery.teacher import TeacherCache, distillation_loss, labelled_positions
from casp_core.run import Run
from casp_core.settings import CROSS_ENTROPY_LOSS, FULL_RECOVERY, RecoveryConfig

STAGE = "recovery"
STATE_FILE = "recovery-state.pt"
ADAPTER_DIR = "adapter"
DISTILL_CE = "distill_ce"
# LLM-Pruner's 100 warm-up steps, but never more than a tenth of a short run.
WARMUP_STEPS = 100
MAX_GRAD_NORM = 1.0


@dataclass
class RecoveryResult:
    """What the report shows: the training curve (one point per optimizer step) and the run's totals."""

    data: dict[str, Any]
    steps: int
    trainable_parameters: int
    precision: str
    curve: list[dict[str, float]] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    resumed_from_step: int | None = None
    teacher: dict[str, Any] | None = None  # the distillation cache's `summary`
    memory_estimate: dict[str, int] | None = None  # casp_core.method.placement's, when the job made one before pruning
    # LoRA: what peft adapted ("modules", "parameters": the names it matched) and the dropout it ran with.
    lora: dict[str, Any] | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


def total_steps(config: RecoveryConfig, n_sequences: int) -> int:
    """`max_steps`, or enough steps for `epochs` passes over the data (the last step may be partial)."""
    if config.max_steps is not None:
        return config.max_steps
    per_step = config.batch_size * config.grad_accum
    return max(1, math.ceil(config.epochs * n_sequences / per_step))


def batch_indices(config: RecoveryConfig, n_sequences: int, step: int) -> list[list[int]]:
    """The forward passes of optimizer step `step`: sequence order is a fresh permutation per epoch (seeded), so a
    resumed run sees exactly the batches the uninterrupted run would have."""
    orders: dict[int, torch.Tensor] = {}
    passes = []
    for micro in range(step * config.grad_accum, (step + 1) * config.grad_accum):
        indices = []
        for position in range(micro * config.batch_size, (micro + 1) * config.batch_size):
            epoch, offset = divmod(position, n_sequences)
            if epoch not in orders:
                generator = torch.Generator().manual_seed(config.seed + epoch)
                orders[epoch] = torch.randperm(n_sequences, generator=generator)
            indices.append(int(orders[epoch][offset]))
        passes.append(indices)
    return passes


def _state_fingerprint(config: RecoveryConfig, data: TrainingData, weights: str) -> dict[str, Any]:
    """What must match for a saved state to be resumed: every setting that changes the run, the data's size and
    the weights the adapters were trained on."""
    settings = config.to_dict()
    settings.pop("save_every")
    return {"settings": settings, "data": data.summary(), "weights": weights}


def recover(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: TrainingData,
    config: RecoveryConfig,
    run: Run | None = None,
    *,
    device: str = "auto",
    state_dir: Path | None = None,
    on_state_saved: Callable[[Path], None] | None = None,
    adapter_dir: Path | None = None,
    teacher: TeacherCache | None = None,
) -> tuple[PreTrainedModel, RecoveryResult]:
    """Trains `model` as `config` says and returns it, on the CPU, in its own dtype (LoRA: with the adapters
    merged; `adapter_dir` receives them as peft saves them, loadable on `model` as it was given). A distillation
    loss needs `teacher`, computed from the dense model over exactly `data`. `on_state_saved` gets the state file
    after each save (the service copies it where a retry elsewhere finds it)."""
    if config.loss != CROSS_ENTROPY_LOSS and teacher is None:
        raise InvalidConfig(f"recovery.loss: {config.loss} needs the dense model's distribution (a job computes it)")
    if teacher is not None and len(teacher.offsets) != len(data) + 1:
        raise InvalidConfig(f"recovery.loss: the teacher cache {teacher.path.name} is not of this recovery's data")
    run = run or Run()
    target = resolve_device(device)
    dtype = model.dtype
    weights = weights_digest(model)
    autocast = bf16_autocast(target)
    # Master weights in float32 unless bf16 autocast runs the matmuls: fp16/bf16 AdamW updates would round away.
    model.to(device=target, dtype=dtype if autocast else torch.float32)
    model.config.use_cache = False
    checkpointing = config.gradient_checkpointing or config.method == FULL_RECOVERY
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    torch.manual_seed(config.seed)
    trained, lora = trainable_model(model, config, run)
    # The model with its adapters in place, as the loss takes it (casp_core.method.next_token)
    student = trained.get_base_model() if isinstance(trained, PeftModel) else trained
    # What trains is in float32 whatever the rest is (adapters; with full, the decoder layers).
    for parameter in trained.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    trainable = {name: parameter for name, parameter in trained.named_parameters() if parameter.requires_grad}
    steps = total_steps(config, len(data))
    optimizer = torch.optim.AdamW(trainable.values(), lr=config.lr, weight_decay=0.0)
    schedule = get_linear_schedule_with_warmup(optimizer, min(WARMUP_STEPS, steps // 10), steps)
    result = RecoveryResult(
        data=data.summary(),
        steps=steps,
        trainable_parameters=sum(parameter.numel() for parameter in trainable.values()),
        precision="bf16 autocast" if autocast else "float32",
        teacher=teacher.summary() if teacher is not None else None,
        lora=lora,
    )
    fingerprint = _state_fingerprint(config, data, weights)
    start = _resume(state_dir, fingerprint, trainable, optimizer, schedule, result, target)
    if start:
        run.report(STAGE, start / steps, f"resumed from step {start} of {steps}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trained.train()
    for step in range(start, steps):
        began = time.perf_counter()
        sequences = batch_indices(config, len(data), step)
        passes = [collate(data, indices, pad_id) for indices in sequences]
        # Next-token targets: the label of position t + 1 is what position t predicts.
        labelled = sum(int(labelled_positions(batch["labels"]).sum()) for batch in passes)
        terms = {"loss": 0.0, "ce": 0.0, "kl": 0.0}
        for indices, batch in zip(sequences, passes, strict=True):
            run.check_cancelled()
            batch = {name: tensor.to(target) for name, tensor in batch.items()}
            taught = None if teacher is None else [tensor.to(target) for tensor in teacher.rows_of(indices)]
            with torch.autocast(target.type, dtype=torch.bfloat16, enabled=autocast):
                ce, kl = loss_terms(student, batch, taught, config.temperature)
            loss = _combined(config, ce, kl) / max(labelled, 1)
            loss.backward()
            terms["loss"] += loss.item()
            terms["ce"] += ce.item() / max(labelled, 1)
            if kl is not None:
                terms["kl"] += kl.item() / max(labelled, 1)
        torch.nn.utils.clip_grad_norm_(trainable.values(), MAX_GRAD_NORM)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        tokens = sum(int(batch["attention_mask"].sum()) for batch in passes)
        result.tokens += tokens
        seconds = time.perf_counter() - began
        result.seconds += seconds
        point = {"step": step + 1, "loss": terms["loss"], "lr": schedule.get_last_lr()[0], "ce": terms["ce"]}
        if teacher is not None:
            point["kl"] = terms["kl"]
        result.curve.append(point)
        both = f" (kl {terms['kl']:.4f}, ce {terms['ce']:.4f})" if teacher is not None else ""
        run.report(
            STAGE,
            (step + 1) / steps,
            f"step {step + 1}/{steps} loss {terms['loss']:.4f}{both} {tokens / max(seconds, 1e-9):,.0f} tokens/s",
        )
        if state_dir is not None and (step + 1) % config.save_every == 0 and step + 1 < steps:
            saved = _save_state(state_dir, fingerprint, step + 1, trainable, optimizer, schedule, result)
            if on_state_saved is not None:
                on_state_saved(saved)
    if config.method == FULL_RECOVERY:
        recovered = trained
    else:
        if adapter_dir is not None:
            trained.save_pretrained(adapter_dir)
        recovered = trained.merge_and_unload()
    if checkpointing:
        recovered.activation_checkpointing_disable()
    recovered.config.use_cache = True
    return recovered.to(device="cpu", dtype=dtype).eval(), result


def trainable_model(
    model: PreTrainedModel, config: RecoveryConfig, run: Run
) -> tuple[torch.nn.Module, dict[str, Any] | None]:
    """`model` with only what `config.method` trains requiring a gradient: LoRA adapters (a peft model around
    it, and what they adapt), or every parameter of its decoder layers."""
    if config.method != FULL_RECOVERY:
        family = family_of(model.config)
        modules, parameters = family.lora_modules(config.target_modules), family.lora_parameters(config.target_modules)
        dropout = config.dropout
        if parameters and dropout:
            # peft cannot drop out a parameter's adapter input (it adds B A to the weight), and one setting
            # covers every adapter of the model.
            dropout = 0.0
            run.warn(
                f"recovery: LoRA dropout 0 instead of {config.dropout:g}: the experts' adapters are on their "
                "weights, which peft trains without dropout, and one dropout covers every adapter"
            )
        lora = LoraConfig(
            r=config.rank,
            lora_alpha=config.alpha,
            lora_dropout=dropout,
            target_modules=modules,
            target_parameters=parameters or None,
            bias="none",
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, lora), {"modules": modules, "parameters": parameters, "dropout": dropout}
    model.requires_grad_(False)
    for layer in decoder_layers(model):
        layer.requires_grad_(True)
    return model, None


def loss_terms(
    student: PreTrainedModel,
    batch: dict[str, torch.Tensor],
    taught: list[torch.Tensor] | None,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pass's cross-entropy and, with the teacher's rows (`taught`: top-k indices, log-probabilities and rest),
    its distillation term, summed over the labelled positions. The logits are taken a chunk of positions at a time
    and recomputed in the backward pass: a batch's full logits (8 x 2048 positions of a 128K vocabulary: 8.4 GB
    in float32, several copies with the loss's) would outweigh a small model's training."""
    hidden = final_hidden_states(student, batch["input_ids"], batch["attention_mask"])
    # Only the labelled positions, in the order the teacher cache lays out their rows.
    positions = labelled_positions(batch["labels"])
    rows, targets = hidden[:, :-1][positions], batch["labels"][:, 1:][positions]
    if taught is None:
        return torch.stack(of_chunks(student, rows, _summed_cross_entropy, targets)).sum(), None

    def both_terms(logits: torch.Tensor, targets: torch.Tensor, *teacher_rows: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [_summed_cross_entropy(logits, targets), distillation_loss(logits, *teacher_rows, temperature)]
        )

    ce, kl = torch.stack(of_chunks(student, rows, both_terms, targets, *taught)).sum(0)
    return ce, kl


def _summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


def _combined(config: RecoveryConfig, ce: torch.Tensor, kl: torch.Tensor | None) -> torch.Tensor:
    """The loss `config.loss` names, summed over the pass's labelled positions."""
    if kl is None:
        return ce
    if config.loss == DISTILL_CE:
        return config.ce_weight * ce + (1 - config.ce_weight) * kl
    return kl


def _save_state(
    state_dir: Path,
    fingerprint: dict[str, Any],
    step: int,
    trainable: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    result: RecoveryResult,
) -> Path:
    """Written beside and renamed over the last save: a kill mid-write leaves the previous one whole."""
    state_dir.mkdir(parents=True, exist_ok=True)
    state = {
        "fingerprint": fingerprint,
        "step": step,
        "trained": {name: parameter.detach() for name, parameter in trainable.items()},
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "curve": result.curve,
        "tokens": result.tokens,
        "seconds": result.seconds,
    }
    partial = state_dir / f".{STATE_FILE}.partial"
    torch.save(state, partial)
    os.replace(partial, state_dir / STATE_FILE)
    return state_dir / STATE_FILE


def _resume(
    state_dir: Path | None,
    fingerprint: dict[str, Any],
    trainable: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
    result: RecoveryResult,
    device: torch.device,
) -> int:
    """The step to start from: that of the saved state when there is one for the same settings and data, else 0."""
    path = state_dir / STATE_FILE if state_dir is not None else None
    if path is None or not path.is_file():
        return 0
    state = torch.load(path, map_location=device, weights_only=True)
    if state["fingerprint"] != fingerprint:
        return 0
    with torch.no_grad():
        for name, parameter in trainable.items():
            parameter.copy_(state["trained"][name])
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    torch.set_rng_state(state["cpu_rng"].cpu())
    if state["cuda_rng"]:
        torch.cuda.set_rng_state_all([rng.cpu() for rng in state["cuda_rng"]])
    result.curve = list(state["curve"])
    result.tokens, result.seconds = state["tokens"], state["seconds"]
    result.resumed_from_step = state["step"]
    return int(state["step"])
