"""Parameters, MACs and latency, on the real stories260K model and on a copy with per-layer shapes."""

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from bench.shapes import llama2_7b_config
from casp_core.errors import InvalidConfig
from casp_core.eval.efficiency import (
    compare_efficiency,
    count_parameters,
    measure_efficiency,
    prefill_macs,
)
from tests.conftest import STORIES
from tests.core.eval.eval_helpers import (
    datasets_dir_or_skip,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
)
from tests.core.eval.eval_models import pruned_checkpoint, uneven_copy

SMALL = {"batch_size": 2, "seq_len": 16, "new_tokens": 8, "repeats": 3, "warmup": 1}


@pytest.fixture(scope="module")
def dense() -> LlamaForCausalLM:
    # Eager attention: its matrix products are plain matmuls, which FlopCounterMode counts on CPU.
    return AutoModelForCausalLM.from_pretrained(STORIES, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def uneven(dense: LlamaForCausalLM) -> LlamaForCausalLM:
    return uneven_copy(dense)


def _flop_counter_macs(model: nn.Module, seq_len: int) -> int:
    counter = FlopCounterMode(display=False)
    input_ids = torch.randint(0, model.config.vocab_size, (1, seq_len))
    with torch.inference_mode(), counter:
        model(input_ids=input_ids, use_cache=False)
    flops = counter.get_total_flops()
    assert flops % 2 == 0
    return flops // 2


def test_parameters_are_the_sum_of_numel(dense: LlamaForCausalLM, uneven: LlamaForCausalLM):
    # Tied embedding and LM head: one tensor, counted once.
    assert dense.lm_head.weight is dense.model.embed_tokens.weight
    unique = {id(p): p.numel() for p in dense.state_dict(keep_vars=True).values()}
    assert count_parameters(dense) == sum(unique.values()) == 260_032  # fixtures/PROVENANCE.md
    assert count_parameters(uneven) == sum(p.numel() for p in uneven.parameters()) < count_parameters(dense)


@pytest.mark.parametrize("which", ["dense", "uneven"])
def test_analytic_macs_equal_flop_counter_over_two(which: str, dense, uneven):
    model = {"dense": dense, "uneven": uneven}[which]
    macs = prefill_macs(model, seq_len=128)
    assert macs["total"] == macs["linear"] + macs["attention"]
    assert macs["total"] == _flop_counter_macs(model, 128)


def test_analytic_macs_of_a_checkpoint_pruned_by_the_pipeline():
    """The project's own pruned class (per-layer head maps, loaded through its remote code) counts alike."""
    pruned_dir, _ = pruned_checkpoint(datasets_dir_or_skip())
    model = AutoModelForCausalLM.from_pretrained(pruned_dir, trust_remote_code=True, attn_implementation="eager")
    assert type(model).__name__ != "LlamaForCausalLM"
    assert prefill_macs(model.eval())["total"] == _flop_counter_macs(model, 128)
    assert count_parameters(model) == sum(p.numel() for p in model.parameters()) < 260_032


def test_uneven_model_has_per_layer_shapes(dense: LlamaForCausalLM, uneven: LlamaForCausalLM):
    assert [layer.mlp.down_proj.in_features for layer in uneven.model.layers] == [172, 142, 112, 82, 52]
    assert [layer.self_attn.q_proj.out_features // 8 for layer in uneven.model.layers] == [8, 6, 4, 2, 2]
    assert prefill_macs(uneven)["total"] < prefill_macs(dense)["total"]


def test_llama2_7b_macs_and_parameters_match_the_paper():
    """The paper's appendix: LLaMA2-7B has 6.74 B parameters and 845.71 G MACs for 128 tokens."""
    with torch.device("meta"):
        model = LlamaForCausalLM(llama2_7b_config())
    macs = prefill_macs(model, seq_len=128)
    assert round(macs["linear"] / 1e9, 2) == 845.71
    assert round(macs["attention"] / 1e9, 2) == 4.29
    assert round(count_parameters(model) / 1e9, 2) == 6.74


def test_latency_is_measured_for_dense_and_pruned(dense: LlamaForCausalLM, uneven: LlamaForCausalLM):
    out = compare_efficiency(dense, uneven, device="cpu", macs_seq_len=32, **SMALL)
    for side in ("dense", "pruned"):
        figures = out[side]
        latency = figures["latency"]
        assert latency["prefill_s"] > 0 and latency["decode_s"] > 0
        assert len(latency["prefill_runs_s"]) == len(latency["decode_runs_s"]) == SMALL["repeats"]
        assert latency["prefill_s"] == sorted(latency["prefill_runs_s"])[1]
        assert (latency["batch_size"], latency["seq_len"], latency["new_tokens"]) == (2, 16, 8)
        assert figures["device"] == "cpu" and figures["torch_version"] == torch.__version__
        assert figures["dtype"] == "float32" and figures["macs_seq_len"] == 32
    assert out["pruned_over_dense"]["params"] == count_parameters(uneven) / count_parameters(dense)
    assert (
        out["pruned_over_dense"]["macs"]
        == prefill_macs(uneven, seq_len=32)["total"] / prefill_macs(dense, seq_len=32)["total"]
    )
    assert 0 < out["pruned_over_dense"]["macs"] < 1


def test_prompt_and_generation_must_fit_the_context(dense: LlamaForCausalLM):
    with pytest.raises(InvalidConfig, match="context 512"):
        measure_efficiency(dense, device="cpu", seq_len=500, new_tokens=20, batch_size=1, repeats=1, warmup=0)
