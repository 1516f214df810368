"""The device memory model (casp_core.method.placement) evaluated at LLaMA2-7B's, Llama-3.2-1B's and the 70B models'
shapes, and at the mixtures of experts Mixtral-8x7B's and Qwen3-30B-A3B's: what pruning would hold on the device
with the whole model resident, and one decoder layer at a time; and what recovery after pruning by half would
hold (casp_core.method.placement.estimate_recovery_memory).

These are estimates from the shapes alone (no model is built), upper bounds by construction, and not yet checked
against a measurement: no GPU was lent to the session that wrote this bench. bench/gpu_llama7b.py records the
estimate beside the measured peak in both modes, on the first machine with a GPU that runs it.
Writes bench/results/device_memory.json and .md.
"""

import argparse
from pathlib import Path
from typing import Any

from transformers import MixtralConfig, Qwen3MoeConfig

from bench.common import RESULTS_DIR, finish_machine_info, machine_info, machine_line, write_json
from bench.shapes import llama2_7b_config, llama_config
from casp_core.method.placement import GIB, JobShape, ModelShape, estimate_device_memory, estimate_recovery_memory
from casp_core.settings import CalibrationConfig, RecoveryConfig

H100_GIB = 80  # the device the targets name (an H200 has 141)


def model_shapes() -> dict[str, ModelShape]:
    """float16/bfloat16 weights, sdpa attention (transformers' default: the score matrix is never stored)."""
    configs = {
        "Llama-3.2-1B": llama_config(
            hidden=2048, layers=16, ffn=8192, heads=32, kv_heads=8, vocab=128256, tie_word_embeddings=True
        ),
        "LLaMA2-7B": llama2_7b_config(),
        "Llama-2-70B": llama_config(hidden=8192, layers=80, ffn=28672, heads=64, kv_heads=8, vocab=32000),
        "Llama-3-70B": llama_config(hidden=8192, layers=80, ffn=28672, heads=64, kv_heads=8, vocab=128256),
        "Mixtral-8x7B": MixtralConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            max_position_embeddings=32768,
        ),
        "Qwen3-30B-A3B": Qwen3MoeConfig(
            hidden_size=2048,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
            tie_word_embeddings=False,
            max_position_embeddings=40960,
        ),
    }
    return {
        name: ModelShape.from_config(config, dtype_bytes=2, eager_attention=False) for name, config in configs.items()
    }


def job_shapes() -> dict[str, JobShape]:
    default = CalibrationConfig()
    return {
        f"{default.n_samples} x {default.seq_len}, batch {default.batch_size}": JobShape(
            default.batch_size, default.seq_len, gradient_allocation=True, alpha_auto=False, dense_target=False
        ),
        f"{default.n_samples} x {default.seq_len}, batch 1": JobShape(
            1, default.seq_len, gradient_allocation=True, alpha_auto=False, dense_target=False
        ),
    }


RECOVERY_RATIO = 0.5
# The default recovery (LoRA, batch 8 x 256 tokens) and what changes its memory most.
RECOVERIES = {
    "lora, cross_entropy": {"method": "lora"},
    "lora, cross_entropy, checkpointing": {"method": "lora", "gradient_checkpointing": True},
    "lora, distill, checkpointing": {"method": "lora", "loss": "distill", "gradient_checkpointing": True},
    "full, distill": {"method": "full", "loss": "distill"},
    "full, distill, batch 1": {"method": "full", "loss": "distill", "batch_size": 1},
}


def recovery_rows() -> list[dict[str, Any]]:
    rows = []
    for model in ("LLaMA2-7B", "Llama-2-70B", "Llama-3-70B", "Mixtral-8x7B", "Qwen3-30B-A3B"):
        shape = model_shapes()[model]
        for name, settings in RECOVERIES.items():
            estimate = estimate_recovery_memory(shape, RecoveryConfig(**settings), RECOVERY_RATIO, autocast=True)
            rows.append(
                {
                    "model": model,
                    "recovery": name,
                    **{key: gib(value) for key, value in estimate.summary().items()},
                    "fits_80_gib": estimate.peak <= H100_GIB * GIB,
                }
            )
    return rows


def gib(count: int) -> float:
    return round(count / GIB, 2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    machine = machine_info()
    rows = []
    for model, shape in model_shapes().items():
        for job_name, job in job_shapes().items():
            estimate = estimate_device_memory(shape, job)
            rows.append(
                {
                    "model": model,
                    "parameters": shape.model_parameters(),
                    "job": job_name,
                    **{name: gib(value) for name, value in estimate.summary().items()},
                    "on_80_gib": "resident"
                    if estimate.resident_peak <= H100_GIB * GIB
                    else "offload"
                    if estimate.offload_peak <= H100_GIB * GIB
                    else "does not fit",
                }
            )
    payload = {
        "machine": finish_machine_info(machine),
        "measured": False,
        "note": "estimates of casp_core.method.placement from the shapes alone, in GiB; not checked against a GPU "
        "measurement (no GPU was lent); float16 weights, sdpa attention, gradient allocation, least_squares",
        "rows": rows,
        "recovery_rows": recovery_rows(),
    }
    write_json(args.out / "device_memory.json", payload)
    (args.out / "device_memory.md").write_text(render(payload))
    return payload


def render(payload: dict[str, Any]) -> str:
    lines = [
        "# Device memory of pruning, by the memory model (estimate, not a measurement)",
        "",
        "`python -m bench.device_memory`: casp_core.method.placement's per-layer memory model evaluated at each "
        "model's shapes, float16 weights, sdpa attention, gradient allocation, `least_squares` compensation, 128 "
        "calibration windows of 2048 tokens. **Not yet checked against a GPU measurement: no GPU was lent to the "
        "session that wrote it.** The figures are upper bounds by construction (each stage's tensors counted as "
        "if all alive at once); bench/gpu_llama7b.py records the estimate beside the measured peak of both modes.",
        "",
        f"Machine: {machine_line(payload['machine'])}.",
        "",
        "| model | parameters | calibration | weights (GiB) | one layer | layer working set | head stage | "
        "offloaded peak | resident peak | on an 80 GiB GPU |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in payload["rows"]:
        lines.append(
            f"| {row['model']} | {row['parameters'] / 1e9:.2f} B | {row['job']} | {row['model_weights']} | "
            f"{row['layer_weights']} | {row['layer_working_set']} | {row['head_stage']} | {row['offload_peak']} | "
            f"{row['resident_peak']} | {row['on_80_gib']} |"
        )
    lines += [
        "",
        "The layer working set is led by the down_proj statistics (C and Q of FFN x FFN in float32 above a width "
        "of 4096, compensation's C_kk and its factor in float64) and one batch's activations; the head stage by "
        "the head and allocation's float32 logits of one chunk of tokens (64 MiB, with their log-softmax and "
        "gradient: casp_core.method.next_token): a 70B model offloaded needs a fraction of an 80 GiB device, "
        "resident it does not fit.",
        "",
        "The mixtures of experts (docs/moe.md) hold every expert's weights in a layer (Mixtral-8x7B: 2.7 GiB a "
        "layer, against LLaMA2-7B's 0.38), and their layer working set is led by verification's float64 copies of "
        "one layer, masked and pruned (Mixtral: 19 GiB); their statistics are one expert's at a time (C_e and Q_e "
        "at the expert's width: 14336 for Mixtral, in float32, 1.5 GiB; 768 for Qwen3-30B-A3B, in float64, 9 MiB) "
        "and none for attention. All 128 of Qwen3-30B-A3B's experts' C and Q at once would be 1.1 GiB per layer, "
        "and the blocks between experts 77 GB. Qwen3-30B-A3B (57 GiB of float16 weights) stays resident on an "
        "80 GiB device; Mixtral-8x7B (87 GiB) offloads one layer at a time.",
        "",
        f"## Recovery after pruning by {RECOVERY_RATIO:.0%}",
        "",
        "Recovery holds the whole pruned model on the device (bf16 autocast: weights in bf16, what trains in "
        "float32 with its gradient and AdamW's two moments), one batch's activations (default 8 x 256 tokens: what "
        "autograd keeps of each layer for the backward pass; with gradient checkpointing each layer's input and one "
        "layer's activations) and the float32 logits of one chunk of the batch's positions (64 MiB, or the batch's "
        "where it is smaller; three copies, six with distillation: the loss recomputes each chunk's logits in the "
        "backward pass). From the model, not a measurement; a job whose estimate exceeds `max_device_memory` is "
        "refused before pruning with what would fit.",
        "",
        "| model | recovery | weights | optimizer state | activations | logits | peak (GiB) | on an 80 GiB GPU |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {row['model']} | {row['recovery']} | {row['weights']} | {row['optimizer_state']} | "
            f"{row['activations']} | {row['logits']} | {row['peak']} | {'fits' if row['fits_80_gib'] else 'refused'} |"
            for row in payload["recovery_rows"]
        ),
        "",
        "Full fine-tuning costs 16 bytes per kept decoder weight (float32 weight, gradient, two moments): about "
        "51 GiB at 7B pruned by half, over 500 GiB at 70B, which recovers with LoRA only.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
