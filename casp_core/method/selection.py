"""Choosing one layer's units (paper, sections 3.1-3.2): Q of its heads and of its FFN channels from the
statistics, then the heads the budget plans for the layer and as many channels as it leaves, each by the
configured solver.

The pipeline (`prune`) chooses once per layer; the temperature search (`temperature`) chooses once per candidate
allocation from the same Q.
"""

from dataclasses import dataclass

import torch
from torch import nn

from casp_core.method.budget import (
    BudgetPlan,
    UniformShape,
    attention_params_removed,
    channel_params,
    channels_to_prune,
)
from casp_core.method.calibration import SecondMoment
from casp_core.method.interaction import block_aggregate, interaction_matrix, objective, offdiag_ratio
from casp_core.method.results import SubLayerReport
from casp_core.method.solvers import diagonal, select_units
from casp_core.method.surgery import LayerPruning, head_columns
from casp_core.model import AttentionGeometry, sublayer_parameters
from casp_core.numerics import check_finite


@dataclass
class LayerQ:
    """Q of the attention heads (block-aggregated) and of the FFN channels of one layer, with each one's share of
    |Q| off the diagonal: that depends on Q alone, so it is read once for all the choices made on it (a sweep's
    ratios, the temperature search's candidates), not once per choice (a pass over Q, at FFN width the largest
    part of a greedy choice)."""

    heads: torch.Tensor
    channels: torch.Tensor
    heads_offdiag_ratio: float
    channels_offdiag_ratio: float


@dataclass
class LayerChoice:
    attn: SubLayerReport
    mlp: SubLayerReport
    attention_removed: int  # parameters the chosen heads take away, key/value heads left without a query included

    @property
    def pruning(self) -> LayerPruning:
        return LayerPruning(tuple(self.attn.pruned), tuple(self.mlp.pruned))


def layer_q(layer: nn.Module, geometry: AttentionGeometry, moments: dict[str, SecondMoment]) -> LayerQ:
    o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
    q_heads = block_aggregate(interaction_matrix(o_proj.weight, moments["attn"].second_moment), geometry.head_dim)
    check_finite(q_heads, "interaction", "Q of the attention heads", layer.self_attn.layer_idx)
    q_channels = interaction_matrix(down_proj.weight, moments["mlp"].second_moment)
    check_finite(q_channels, "interaction", "Q of the FFN channels", layer.self_attn.layer_idx)
    return LayerQ(q_heads, q_channels, offdiag_ratio(q_heads), offdiag_ratio(q_channels))


def solve_sublayer(
    solver: str,
    q_units: torch.Tensor,
    q_offdiag_ratio: float,
    k: int,
    weight: torch.Tensor,
    moment: SecondMoment,
    block: int,
) -> SubLayerReport:
    pruned, lower_bound = select_units(
        solver, q_units, k, weight=weight, second_moment=moment.second_moment, mean=moment.mean, block=block
    )
    return SubLayerReport(
        units=q_units.shape[0],
        pruned=sorted(int(i) for i in pruned),
        objective=objective(q_units, pruned),
        diagonal_objective=objective(q_units, diagonal(q_units, k)),
        offdiag_ratio=q_offdiag_ratio,
        lower_bound=lower_bound,
    )


def solve_uniform_heads(
    solver: str,
    q_heads: torch.Tensor,
    q_offdiag_ratio: float,
    geometry: AttentionGeometry,
    shape: UniformShape,
    weight: torch.Tensor,
    moment: SecondMoment,
) -> SubLayerReport:
    """The uniform shape's heads: `shape.kv_heads` whole key/value groups stay, each with `shape.heads_per_kv`
    query heads, so that LLaMA's repeat_kv (one key/value head per equal contiguous group) still holds.

    Two choices by the same solver on the same Q. Groups first, on the group-aggregated Q (Q̃ summed over each
    group's query heads, as heads are Q summed over their head_dim columns): a group's cost is that of all its
    query heads together, and its key and value rows go with it. Then, in each kept group alone, the query heads
    to drop on that group's block of Q. The second step leaves out the interactions between heads of different
    groups: the fixed count per group is a constraint of each group, and solving each group on its own lets every
    solver (greedy, relaxation, wanda_sp, ...) apply unchanged. Under MHA the groups are the heads themselves.
    """
    groups = {kv: [q for q, k in enumerate(geometry.kv_of_query) if k == kv] for kv in range(geometry.num_kv_heads)}
    group_size = geometry.num_heads // geometry.num_kv_heads
    pruned: list[int] = []
    if shape.kv_heads < geometry.num_kv_heads:
        q_groups = block_aggregate(q_heads, group_size)
        gone, _ = select_units(
            solver,
            q_groups,
            geometry.num_kv_heads - shape.kv_heads,
            weight=weight,
            second_moment=moment.second_moment,
            mean=moment.mean,
            block=group_size * geometry.head_dim,
        )
        pruned += [q for kv in gone.tolist() for q in groups[kv]]
        groups = {kv: heads for kv, heads in groups.items() if kv not in set(gone.tolist())}
    if shape.heads_per_kv < group_size:
        for heads in groups.values():
            columns = head_columns(geometry, heads)
            gone, _ = select_units(
                solver,
                q_heads[heads][:, heads],
                group_size - shape.heads_per_kv,
                weight=weight[:, columns],
                second_moment=moment.second_moment[columns][:, columns],
                mean=moment.mean[columns],
                block=geometry.head_dim,
            )
            pruned += [heads[i] for i in gone.tolist()]
    chosen = torch.tensor(sorted(pruned), dtype=torch.int64)
    return SubLayerReport(
        units=q_heads.shape[0],
        pruned=sorted(pruned),
        objective=objective(q_heads, chosen),
        diagonal_objective=objective(q_heads, diagonal(q_heads, len(pruned))),
        offdiag_ratio=q_offdiag_ratio,
        lower_bound=None,
    )


def choose_units(
    layer: nn.Module,
    geometry: AttentionGeometry,
    q: LayerQ,
    moments: dict[str, SecondMoment],
    plan: BudgetPlan | UniformShape,
    index: int,
    removed_before: int,
    solver: str,
) -> LayerChoice:
    """Layer `index`'s planned heads, then its channels; `removed_before` is what the earlier layers removed. A
    uniform shape plans the same heads per key/value group and the same channel count for every layer."""
    o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
    if isinstance(plan, UniformShape):
        attn = solve_uniform_heads(
            solver, q.heads, q.heads_offdiag_ratio, geometry, plan, o_proj.weight, moments["attn"]
        )
    else:
        n_heads = plan.layers[index].heads
        attn = solve_sublayer(
            solver, q.heads, q.heads_offdiag_ratio, n_heads, o_proj.weight, moments["attn"], geometry.head_dim
        )
    attention_removed = attention_params_removed(layer, geometry, attn.pruned)
    if isinstance(plan, UniformShape):
        n_channels = plan.pruned_channels
    else:
        n_channels = channels_to_prune(plan, index, removed_before, attention_removed)
    mlp = solve_sublayer(solver, q.channels, q.channels_offdiag_ratio, n_channels, down_proj.weight, moments["mlp"], 1)
    return LayerChoice(attn, mlp, attention_removed)


def params_kept(layer: nn.Module, choice: LayerChoice) -> int:
    """The layer's attention + MLP parameters once its chosen units are gone. Counted after compensation: the
    mean-bias kind gives o_proj/down_proj biases the dense layer did not have."""
    return sum(sublayer_parameters(layer)) - choice.attention_removed - len(choice.mlp.pruned) * channel_params(layer)
