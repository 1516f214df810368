"""Removing units physically computes exactly what masking them computes."""

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from bench.shapes import llama_config
from casp_core.method.surgery import LayerPruning, mask_layer, remove_units
from casp_core.model import attention_geometry, decoder_layers


def tiny_llama(heads: int, kv_heads: int, layers: int = 3, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = llama_config(
        hidden=48,
        layers=layers,
        ffn=40,
        heads=heads,
        kv_heads=kv_heads,
        vocab=97,
        head_dim=48 // heads,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


def masked_copy(model, prunings):
    masked = copy.deepcopy(model)
    for layer, pruning in zip(decoder_layers(masked), prunings, strict=True):
        mask_layer(layer, attention_geometry(masked, layer), pruning)
    return masked


def assert_same_model(masked, pruned, vocab: int):
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        difference = (masked(tokens).logits - pruned(tokens).logits).abs().max().item()
    assert difference <= 1e-5
    prompt = tokens[:1, :5]
    expected = masked.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True)
    assert torch.equal(pruned.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True), expected)
    # The cache path and the full forward agree on the pruned model itself.
    with torch.no_grad():
        full = pruned(expected).logits[:, -1]
        step = pruned(expected[:, :-1], use_cache=True)
        cached = pruned(expected[:, -1:], past_key_values=step.past_key_values).logits[:, -1]
    assert (full - cached).abs().max().item() <= 1e-5


def test_multi_head_attention():
    model = tiny_llama(heads=6, kv_heads=6)
    prunings = [
        LayerPruning((0, 3), (1, 2, 39)),
        LayerPruning((), ()),
        LayerPruning((1, 2, 4, 5), tuple(range(0, 40, 2))),
    ]
    pruned = remove_units(model, prunings)
    assert pruned.config.layer_kv_of_query == [[0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 1]]
    assert pruned.config.layer_intermediate_sizes == [37, 40, 20]
    assert_same_model(masked_copy(model, prunings), pruned, 97)


def test_grouped_query_attention_whole_groups():
    model = tiny_llama(heads=8, kv_heads=4)  # groups {0,1} {2,3} {4,5} {6,7}
    prunings = [LayerPruning((2, 3), (5,)), LayerPruning((0, 1, 6, 7), ()), LayerPruning((), ())]
    pruned = remove_units(model, prunings)
    assert pruned.config.layer_num_kv_heads == [3, 2, 4]
    assert pruned.model.layers[0].self_attn.k_proj.out_features == 3 * 6
    assert not pruned.model.layers[0].self_attn.gather_kv  # even groups still use repeat_kv
    assert_same_model(masked_copy(model, prunings), pruned, 97)


def test_grouped_query_attention_uneven_groups():
    model = tiny_llama(heads=8, kv_heads=4)
    prunings = [LayerPruning((0, 2, 3, 5), (0, 1)), LayerPruning((7,), ()), LayerPruning((1, 2, 4), (3,))]
    pruned = remove_units(model, prunings)
    assert pruned.config.layer_kv_of_query == [[0, 1, 2, 2], [0, 0, 1, 1, 2, 2, 3], [0, 1, 2, 3, 3]]
    assert pruned.model.layers[0].self_attn.gather_kv
    assert_same_model(masked_copy(model, prunings), pruned, 97)


def test_layer_with_nothing_left():
    model = tiny_llama(heads=4, kv_heads=2)
    prunings = [LayerPruning((0, 1, 2, 3), tuple(range(40))), LayerPruning((1,), ()), LayerPruning((), ())]
    pruned = remove_units(model, prunings)
    assert pruned.config.layer_kv_of_query[0] == [] and pruned.config.layer_intermediate_sizes[0] == 0
    assert_same_model(masked_copy(model, prunings), pruned, 97)


def test_real_gqa_model(stories):
    model, tokenizer = stories
    prunings = [
        LayerPruning((0, 1, 5), (3, 4, 100)),
        LayerPruning((), ()),
        LayerPruning((2, 3), (1,)),
        LayerPruning((0, 2, 4, 6, 7), ()),
        LayerPruning((1, 2, 3, 4, 5, 6), tuple(range(0, 172, 3))),
    ]
    pruned = remove_units(model, prunings)
    masked = masked_copy(model, prunings)
    assert_same_model(masked, pruned, tokenizer.vocab_size)
    removed = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in pruned.parameters())
    # q rows + o columns per head (2 * 8 * 64); k and v rows per key/value head gone (2 * 8 * 64);
    # gate + up rows and a down column per channel (3 * 64).
    heads, kv_heads, channels = 16, 1 + 1 + 3, 3 + 1 + 58
    assert removed == heads * 1024 + kv_heads * 1024 + channels * 192


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_stay_in_their_dtype(dtype):
    model = tiny_llama(heads=8, kv_heads=4).to(dtype)
    pruned = remove_units(model, [LayerPruning((0, 2, 3), (1,)), LayerPruning((), ()), LayerPruning((5,), ())])
    assert all(p.dtype == dtype for p in pruned.parameters())
