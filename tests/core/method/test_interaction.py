"""Q = (W Wᵀ) ⊙ E[YᵀY] is exact: z'Qz is the mean squared norm of the removed part of the output."""

import torch

from casp_core import data
from casp_core.method.calibration import record_inputs
from casp_core.method.interaction import SYMMETRISED_ROWS, block_aggregate, interaction_matrix, objective, offdiag_ratio


def _calibration_tokens(tokenizer, datasets_dir: str) -> torch.Tensor:
    text = data.load_text(data.parse_source("wikitext2:validation", "train"), datasets_dir)
    return data.sample_windows(data.tokenize(text, tokenizer, add_bos=False), 8, 64, seed=1)


def test_z_q_z_equals_the_removed_output_energy(stories, datasets_dir):
    model, tokenizer = stories
    model.double()  # the identity is exact; float64 keeps rounding far below the 1e-4 bound
    layer = model.model.layers[2]
    o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
    seen: dict[str, list[torch.Tensor]] = {"attn": [], "mlp": []}
    hooks = [
        o_proj.register_forward_pre_hook(lambda _m, args: seen["attn"].append(args[0].reshape(-1, args[0].shape[-1]))),
        down_proj.register_forward_pre_hook(
            lambda _m, args: seen["mlp"].append(args[0].reshape(-1, args[0].shape[-1]))
        ),
    ]
    tokens = _calibration_tokens(tokenizer, datasets_dir)
    model.requires_grad_(False)
    with torch.no_grad(), record_inputs({"attn": o_proj, "mlp": down_proj}) as moments:
        for batch in tokens.split(4):
            model(batch, use_cache=False)
    for hook in hooks:
        hook.remove()

    head_dim = layer.self_attn.head_dim
    heads = torch.tensor([1, 4, 6])
    columns = torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads.tolist()])
    channels = torch.tensor([0, 5, 17, 40, 99, 171])
    for name, linear, units, cols, block in (
        ("attn", o_proj, heads, columns, head_dim),
        ("mlp", down_proj, channels, channels, 1),
    ):
        inputs = torch.cat(seen[name])
        removed = inputs[:, cols] @ linear.weight[:, cols].T  # the output of the pruned units alone
        measured = float(removed.pow(2).sum() / inputs.shape[0])
        q = interaction_matrix(linear.weight, moments[name].second_moment)
        q_units = block_aggregate(q, block) if block > 1 else q
        predicted = objective(q_units, units)
        assert measured > 0
        assert abs(predicted - measured) / measured <= 1e-4, (name, predicted, measured)


def test_block_aggregation_sums_blocks():
    q = torch.arange(36, dtype=torch.float64).view(6, 6)
    q = q + q.T
    heads = block_aggregate(q, 2)
    assert heads.shape == (3, 3)
    assert heads[1, 2] == q[2:4, 4:6].sum()
    # A head set's cost through Q̃ equals the cost of its columns through Q.
    assert objective(heads, torch.tensor([0, 2])) == objective(q, torch.tensor([0, 1, 4, 5]))


def test_offdiag_ratio():
    assert offdiag_ratio(torch.eye(4)) == 0.0
    q = torch.tensor([[1.0, -1.0], [-1.0, 1.0]])
    assert offdiag_ratio(q) == 0.5


def test_q_is_symmetrised_in_place_bit_for_bit_across_bands():
    """Q is made symmetric a band of rows at a time (no second d x d matrix): the result is (q + qᵀ) / 2 exactly,
    for a width that spans several bands and ends in a partial one."""
    width = 2 * SYMMETRISED_ROWS + 37
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(16, width, generator=generator)
    # Not symmetric, as C and WᵀW from rounded products need not be: symmetrising has something to do.
    second_moment = torch.rand(width, width, generator=generator)
    q = (weight.T @ weight) * second_moment
    assert not torch.equal(q, q.T)
    assert torch.equal(interaction_matrix(weight, second_moment), (q + q.T) * 0.5)
