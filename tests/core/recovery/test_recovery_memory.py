"""Recovery's device memory (casp_core.method.placement.estimate_recovery_memory): what each setting costs by the model,
and a job whose recovery would not fit within max_device_memory refused before any pruning, with what would fit."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MixtralConfig,
    Olmo2Config,
    OlmoeConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from bench.shapes import llama2_7b_config
from casp_core.errors import DeviceMemoryTooSmall
from casp_core.job.run import run_job
from casp_core.method.next_token import final_hidden_states
from casp_core.method.placement import (
    GIB,
    ModelShape,
    PlacementPlan,
    byte_size,
    check_recovery_fits,
    estimate_recovery_memory,
)
from casp_core.model import load_model
from casp_core.recovery.train import trainable_model
from casp_core.run import Run
from casp_core.settings import RecoveryConfig
from tests.conftest import STORIES, small_config
from tests.core.device_placement import OTHER_DEVICE

LLAMA2_7B = ModelShape.from_config(llama2_7b_config(), dtype_bytes=2, eager_attention=False)


def recovery(**changes) -> RecoveryConfig:
    return RecoveryConfig(**{"method": "lora", **changes})


def test_what_each_setting_costs_at_llama2_7b_pruned_by_half():
    lora = estimate_recovery_memory(LLAMA2_7B, recovery(), 0.5, autocast=True)
    # About 3.5 B kept decoder weights and 0.26 B of embedding and head in bf16.
    assert 6.9e9 < lora.weights < 7.1e9
    # Rank 8 on all seven projections: about 20 M adapter weights, 16 bytes each with gradient and moments.
    assert 0.25 * GIB < lora.optimizer_state < 0.35 * GIB
    full = estimate_recovery_memory(LLAMA2_7B, recovery(method="full"), 0.5, autocast=True)
    # Full: 4 bytes of float32 weight and 12 of gradient and moments per kept decoder weight.
    assert full.optimizer_state == pytest.approx(3 * (full.weights - 0.26e9 * 2), rel=0.02)
    assert full.peak > 48 * GIB > 1.8 * lora.peak
    checkpointed = estimate_recovery_memory(LLAMA2_7B, recovery(gradient_checkpointing=True), 0.5, autocast=True)
    assert checkpointed.activations < lora.activations / 5
    # The loss takes the logits 524 positions at a time (64 MiB of float32 over 32000 tokens), whatever the batch;
    # distillation holds more copies.
    distill = estimate_recovery_memory(LLAMA2_7B, recovery(loss="distill"), 0.5, autocast=True)
    assert distill.logits == 2 * lora.logits == 2 * 3 * 524 * 32000 * 4
    longer = estimate_recovery_memory(LLAMA2_7B, recovery(max_seq_len=512), 0.5, autocast=True)
    assert longer.activations == pytest.approx(2 * lora.activations) and longer.logits == lora.logits
    shorter = estimate_recovery_memory(LLAMA2_7B, recovery(batch_size=1), 0.5, autocast=True)
    assert shorter.logits == 3 * 256 * 32000 * 4  # a batch under one chunk
    # Without bf16 autocast everything is float32.
    float32 = estimate_recovery_memory(LLAMA2_7B, recovery(), 0.5, autocast=False)
    assert float32.weights == 2 * lora.weights


LAYER = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2}
SMALL = {**LAYER, "vocab_size": 512, "max_position_embeddings": 256, "pad_token_id": 0, "eos_token_id": 1}
EXPERTS = {"num_experts_per_tok": 2, "intermediate_size": 48}
FAMILIES: dict[str, Callable[[int], PretrainedConfig]] = {
    "llama": lambda layers: LlamaConfig(**SMALL, num_hidden_layers=layers),
    "gemma2": lambda layers: Gemma2Config(**SMALL, num_hidden_layers=layers, head_dim=16),
    "gemma3": lambda layers: Gemma3TextConfig(**SMALL, num_hidden_layers=layers, head_dim=16),
    "qwen3": lambda layers: Qwen3Config(**SMALL, num_hidden_layers=layers, head_dim=16),
    "olmo2": lambda layers: Olmo2Config(**SMALL, num_hidden_layers=layers),
    "phi3": lambda layers: Phi3Config(**SMALL, num_hidden_layers=layers),
    "mixtral": lambda layers: MixtralConfig(**{**SMALL, **EXPERTS}, num_hidden_layers=layers, num_local_experts=4),
    "qwen3_moe": lambda layers: Qwen3MoeConfig(
        **SMALL, num_hidden_layers=layers, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16
    ),
    "olmoe": lambda layers: OlmoeConfig(**SMALL, num_hidden_layers=layers, num_experts=4, num_experts_per_tok=2),
}
EAGER = ("gemma2", "gemma3_text")  # no sdpa in transformers for these
BATCH, SEQ = 4, 64


def kept_for_backward(config: PretrainedConfig, settings: RecoveryConfig) -> int:
    """The bytes autograd keeps for the backward pass of one forward of a random model of `config` made trainable
    as recovery makes it, the model's own weights left out."""
    torch.manual_seed(0)
    config._attn_implementation = "eager" if config.model_type in EAGER else "sdpa"
    trained, _ = trainable_model(AutoModelForCausalLM.from_config(config), settings, Run())
    student = trained.get_base_model() if isinstance(trained, PeftModel) else trained
    student.train()
    weights = {parameter.untyped_storage().data_ptr() for parameter in student.parameters()}
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(2, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        final_hidden_states(student, tokens, torch.ones_like(tokens))
    return sum(kept.values())


@pytest.mark.parametrize(
    ("family", "changes"),
    [(family, {}) for family in FAMILIES] + [("llama", {"dropout": 0.0}), ("qwen3", {"target_modules": ["q_proj"]})],
)
def test_the_activations_estimated_hold_what_each_family_s_layer_keeps_for_the_backward_pass(family, changes):
    """What one more decoder layer adds to what autograd keeps (float32, no checkpointing) is at most the
    estimate's activations of a layer, and not far under it: the estimate once counted LLaMA's layer with LoRA's
    dropout at two thirds of what it keeps (SmolLM2's recovery then peaked at twice its estimate). Adapting fewer
    projections keeps less (a frozen projection's input is not kept for it): the estimate counts every one's."""
    settings = recovery(batch_size=BATCH, max_seq_len=SEQ, **changes)
    measured = (kept_for_backward(FAMILIES[family](3), settings) - kept_for_backward(FAMILIES[family](1), settings)) / 2
    shapes = [
        ModelShape.from_config(config, dtype_bytes=4, eager_attention=config.model_type in EAGER)
        for config in (FAMILIES[family](3), FAMILIES[family](1))
    ]
    estimated = [estimate_recovery_memory(shape, settings, 0.0, autocast=False).activations for shape in shapes]
    per_layer = (estimated[0] - estimated[1]) / 2
    assert measured <= per_layer <= 1.6 * measured, (measured, per_layer)


def test_a_recovery_that_does_not_fit_is_refused_before_any_pruning(tmp_path: Path):
    model, _ = load_model(str(STORIES))
    big = {"method": "lora", "batch_size": 64, "max_seq_len": 512, "max_steps": 1}
    config = small_config(0.3, device=str(OTHER_DEVICE), recovery=big, max_device_memory="64MiB")
    unlimited = PlacementPlan.of(small_config(0.3, device=str(OTHER_DEVICE)), model.config)
    needed = check_recovery_fits(model, config.recovery, 0.3, unlimited, OTHER_DEVICE)
    # Eager attention's scores of 64 x 512 tokens lead, then the float32 logits over 512 tokens, three times.
    assert (needed.activations, needed.logits) == (1612.5 * 2**20, 192 * 2**20)
    stages: list[str] = []
    run = Run(progress=lambda stage, fraction, message="": stages.append(stage))
    with pytest.raises(DeviceMemoryTooSmall) as error:
        run_job(str(STORIES), config, tmp_path / "out", run)
    assert error.value.code == "device_memory_too_small"
    message = error.value.message
    assert message.startswith(
        f"max_device_memory: 64.0 MiB on cpu:0 is less than the estimated {byte_size(needed.peak)} recovery "
        f"needs ({needed.parts()})"
    ), message
    # What would fit, each with its own estimate: halved until it does.
    assert message.endswith("; would fit: max_seq_len 16 (57.8 MiB), batch_size 2 (57.8 MiB)"), message
    assert not {"allocation", "pruning"} & set(stages) and not (tmp_path / "out").exists()
    # Within the limit the same job is planned as before.
    enough = PlacementPlan.of(config.model_copy(update={"max_device_memory": needed.peak}), model.config)
    assert check_recovery_fits(model, config.recovery, 0.3, enough, OTHER_DEVICE)
