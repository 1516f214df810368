"""Inference efficiency of a causal LM: parameters, MACs of a prefill, and measured latency.

The settings follow the paper's efficiency appendix: MACs for one sequence of 128 tokens in the prefill,
prefill latency for a batch of 32 x 128 tokens, decoding latency while generating 128 new tokens; each
latency is the median of repeated runs after warm-up runs. Dense and pruned models are measured by the
same code on the same device (`compare_efficiency`), so their figures can be set side by side.

MACs are counted from the module shapes, so per-layer shapes of a pruned model count as they are:
- every `nn.Linear` (q/k/v/o, gate/up/down, lm_head) at every position: in_features x out_features
  per token;
- attention: per layer, QKᵀ and softmax(·)V, each (query heads x head_dim x T²) per sequence, the full
  T x T matrices, as the attention kernels compute them (and as torch's FlopCounterMode counts them).
Element-wise work (norms, rotary embedding, activations, softmax) is not counted. The paper's figure
for LLaMA2-7B (845.71 G) is `linear` alone: the attention products add 4.29 G to it.
One MAC is two FLOPs in FlopCounterMode's convention.
"""

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from casp_core.errors import InvalidConfig
from casp_core.families import projections
from casp_core.model import decoder_layers, resolve_device


def count_parameters(model: nn.Module) -> int:
    """Parameters the model holds; tied weights (embedding and LM head) count once."""
    return sum(p.numel() for p in model.parameters())


def _head_dim(attention: nn.Module, model: nn.Module) -> int:
    head_dim = getattr(attention, "head_dim", None)
    if head_dim is None:
        config = model.config  # type: ignore[union-attr]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim)


def prefill_macs(model: nn.Module, *, seq_len: int = 128, batch_size: int = 1) -> dict[str, int]:
    """MACs of one forward pass over `batch_size` x `seq_len` tokens: `linear`, `attention` and `total`."""
    tokens = batch_size * seq_len
    linear = tokens * sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    attention = 0
    for layer in decoder_layers(model):
        head_dim = _head_dim(layer.self_attn, model)
        query_heads = projections(layer).q.out_features // head_dim
        # QKᵀ and the weighted sum of V, each (T x head_dim) x (head_dim x T) per head.
        attention += 2 * batch_size * query_heads * head_dim * seq_len * seq_len
    return {"linear": linear, "attention": attention, "total": linear + attention}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_runs(run: Callable[[], object], device: torch.device, *, repeats: int, warmup: int) -> list[float]:
    """Wall-clock seconds of `repeats` runs of `run`, after `warmup` runs that are not timed (kernel
    selection, allocator growth and caches make the first runs slower)."""
    for _ in range(warmup):
        run()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def device_info(device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {
        "device": str(device),
        "device_name": name,
        "torch_version": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
    }


def measure_latency(
    model: PreTrainedModel,
    *,
    device: str,
    batch_size: int = 32,
    seq_len: int = 128,
    new_tokens: int = 128,
    repeats: int = 10,
    warmup: int = 2,
    seed: int = 0,
) -> dict[str, Any]:
    """Median seconds of a prefill of `batch_size` x `seq_len` random tokens, and of greedy generation of
    exactly `new_tokens` tokens after such a prompt (with the KV cache; the time includes the prompt's
    prefill, as a request's decoding does). The model is moved to `device` in place."""
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and seq_len + new_tokens > context:
        raise InvalidConfig(f"efficiency: seq_len + new_tokens = {seq_len + new_tokens} exceeds the context {context}")
    target = resolve_device(device)
    model.to(target).eval()
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=generator).to(target)
    attention_mask = torch.ones_like(input_ids)
    eos = model.generation_config.eos_token_id
    generation = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # EOS is suppressed, so every run decodes the same number of tokens
        do_sample=False,
        use_cache=True,
        eos_token_id=eos,
        pad_token_id=(eos[0] if isinstance(eos, list) else eos) if eos is not None else 0,
    )

    def prefill() -> object:
        # A prefill builds the KV cache that decoding then reads.
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)

    def decode() -> object:
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation)
        assert output.shape[1] == seq_len + new_tokens
        return output

    with torch.inference_mode():
        prefill_runs = _timed_runs(prefill, target, repeats=repeats, warmup=warmup)
        decode_runs = _timed_runs(decode, target, repeats=repeats, warmup=warmup)
    return {
        "prefill_s": statistics.median(prefill_runs),
        "decode_s": statistics.median(decode_runs),
        "prefill_runs_s": prefill_runs,
        "decode_runs_s": decode_runs,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "warmup": warmup,
    }


def measure_efficiency(
    model: PreTrainedModel,
    *,
    device: str,
    macs_seq_len: int = 128,
    batch_size: int = 32,
    seq_len: int = 128,
    new_tokens: int = 128,
    repeats: int = 10,
    warmup: int = 2,
) -> dict[str, Any]:
    """Parameters, prefill MACs of one `macs_seq_len`-token sequence, latency (see `measure_latency`), and
    where it was measured."""
    macs = prefill_macs(model, seq_len=macs_seq_len)
    latency = measure_latency(
        model,
        device=device,
        batch_size=batch_size,
        seq_len=seq_len,
        new_tokens=new_tokens,
        repeats=repeats,
        warmup=warmup,
    )
    return {
        "params": count_parameters(model),
        "macs": macs["total"],
        "macs_linear": macs["linear"],
        "macs_attention": macs["attention"],
        "macs_seq_len": macs_seq_len,
        "latency": latency,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **device_info(resolve_device(device)),
    }


def compare_efficiency(
    dense: PreTrainedModel, pruned: PreTrainedModel, *, device: str, **settings: int
) -> dict[str, Any]:
    """Both models measured with the same settings on the same device, one after the other, and the
    pruned model's figures as a fraction of the dense one's. `settings` are `measure_efficiency`'s."""
    out = {
        "dense": measure_efficiency(dense, device=device, **settings),
        "pruned": measure_efficiency(pruned, device=device, **settings),
    }
    out["pruned_over_dense"] = efficiency_ratios(out["dense"], out["pruned"])
    return out


def efficiency_ratios(dense: dict[str, Any], pruned: dict[str, Any]) -> dict[str, float]:
    """pruned / dense for parameters, MACs and the two latencies (below 1 is a gain)."""
    return {
        "params": pruned["params"] / dense["params"],
        "macs": pruned["macs"] / dense["macs"],
        "prefill_s": pruned["latency"]["prefill_s"] / dense["latency"]["prefill_s"],
        "decode_s": pruned["latency"]["decode_s"] / dense["latency"]["decode_s"],
    }
