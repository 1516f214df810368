"""Compensation: refit the kept input columns of o_proj and down_proj by least squares, or FLAP's mean bias.

A sub-layer computes W y with W its weight (out x d_in) and y its input. Pruning the columns p of W leaves
W_k y_k, which misses W_p y_p. The best linear stand-in for the missing part, in expectation over the
calibration tokens, is W_p y_p ≈ D y_k with

    D = W_p C_pk C_kk^-1,   C = E[y yᵀ] (the statistics CASP already has),

so the kept columns become W_k + D (SparseGPT, ZipLM and SlimGPT make updates of this kind; the CASP paper
leaves the kept weights as they were). C_kk is damped by `damping` x its mean diagonal and solved by Cholesky
in float64; when it is still not positive definite the damping grows tenfold (with a warning) until it is.

With sequential calibration the layer's inputs y come from the already pruned layers (the pruned stream), and
the fit above makes the kept units reproduce what this layer, unpruned, would output on them. The dense-target
variant (GPTAQ-style) asks instead for the dense model's output on its own inputs y_d (the dense stream):
minimise E||W y_d - (W_k + D) y_k||² + λ||D||², whose solution is

    D = (W M_:k - W_k C_kk)(C_kk + λI)^-1,   M = E[y_d yᵀ] (the cross-moment of the two streams),

which is the update above when the streams are one (M = C, so W M_:k - W_k C_kk = W_p C_pk). It refits a layer
that loses no unit too, since the drift of its inputs still leaves an error to reduce.

FLAP (An et al., AAAI 2024) compensates with a bias instead: b = W_p E[y_p], the removed columns' output
averaged over the calibration tokens, added to the sub-layer's output bias (created where the model has none), so
the pruned sub-layer's output is unchanged on average. The kept weights stay as they were; the error left is
E||W_p y_p - b||² = E||W_p y_p||² - ||b||², the removed part's variance around its mean.
"""

import logging
from dataclasses import dataclass

import torch
from torch import nn

from casp_core.calibration import SecondMoment, StreamCrossMoment
from casp_core.config import MEAN_BIAS_COMPENSATION
from casp_core.model import AttentionGeometry
from casp_core.surgery import LayerPruning, head_columns

logger = logging.getLogger(__name__)

MAX_DAMPING_GROWTH = 6  # up to 10^6 x the requested damping before giving up on the refit


# What a CompensationReport's errors measure the sub-layer's output against.
SAME_INPUTS = "unpruned_layer_on_same_inputs"  # W y on the inputs the layer sees: the removed units' part only
DENSE_MODEL = "dense_model"  # W y_d on the dense stream: also what the earlier layers' pruning shifted


@dataclass
class CompensationReport:
    """Expected squared error of the sub-layer's output per token against `reference`, before and after."""

    error_before: float
    error_after: float
    damping: float  # relative to the mean diagonal of C_kk, as finally used (0.0 when nothing was refitted)
    reference: str = SAME_INPUTS  # SAME_INPUTS or DENSE_MODEL


@dataclass
class LeastSquaresFit:
    update: torch.Tensor  # D, float64 (out x |k|), to add to the kept columns
    damping: float


def fit_kept_columns(
    weight: torch.Tensor,
    second_moment: torch.Tensor,
    pruned: list[int],
    kept_columns: list[int],
    damping: float,
    cross_moment: torch.Tensor | None = None,
) -> LeastSquaresFit:
    """D = (W M_:k - W_k C_kk)(C_kk + λI)^-1 with λ = damping x mean diag(C_kk), in float64 by Cholesky.

    `cross_moment` is M = E[y_d yᵀ] for the dense target; without it M = C and the numerator is W_p C_pk.
    """
    # Each block is cut from C before it is widened to float64: a float64 copy of the whole C (and an identity
    # beside C_kk) would be the largest thing this layer allocates, the size of a layer's weights at 7B.
    c_kk = second_moment[kept_columns][:, kept_columns].double()
    # Damped on its own diagonal, which is put back from a copy after: no second |k| x |k| matrix.
    diagonal = c_kk.diagonal().clone()
    scale = float(diagonal.mean().clamp(min=torch.finfo(torch.float64).tiny))
    for growth in range(MAX_DAMPING_GROWTH + 1):
        used = damping * 10**growth
        c_kk.diagonal().copy_(diagonal + used * scale)
        factor, info = torch.linalg.cholesky_ex(c_kk)
        if int(info) == 0:
            break
        logger.warning("C_kk is not positive definite with damping %.3g; retrying with %.3g", used, used * 10)
    else:
        raise torch.linalg.LinAlgError(f"C_kk stays singular up to damping {used:.3g}")
    c_kk.diagonal().copy_(diagonal)
    # The numerator as weights @ momentsᵀ, so that D = weights @ ((C_kk + λI)^-1 moments)ᵀ (C_kk is symmetric).
    weight = weight.detach()
    if cross_moment is None:
        del c_kk
        weights = weight[:, pruned].double()  # W_p
        moments = second_moment[kept_columns][:, pruned].double()  # C_kp
    else:
        weights = torch.cat([weight, weight[:, kept_columns]], dim=1).double()  # [W, W_k]
        moments = torch.cat([cross_moment[:, kept_columns].T.double(), -c_kk], dim=1)  # [M_:kᵀ, -C_kk]
        del c_kk
    solved = torch.cholesky_solve(moments, factor)
    del moments, factor
    return LeastSquaresFit(update=weights @ solved.T, damping=used)


def removal_error(
    weight: torch.Tensor,
    second_moment: torch.Tensor,
    pruned: list[int],
    kept_columns: list[int],
    update: torch.Tensor | None,
    dense: StreamCrossMoment | None = None,
) -> float:
    """The expected squared output error per token of the kept columns plus `update` (None: as they are), with
    the undamped moments.

    Against the same layer on the same inputs: E||W_p y_p - D y_k||² = tr(W_p C_pp W_pᵀ) - 2 tr(D C_kp W_pᵀ)
    + tr(D C_kk Dᵀ). Against the dense model (`dense` given), with W' = W_k + D:
    E||W y_d - W' y_k||² = tr(W C_d Wᵀ) - 2 tr(W' M_:kᵀ Wᵀ) + tr(W' C_kk W'ᵀ).
    """
    if dense is None:
        w_pruned = weight.detach()[:, pruned].double()
        c_pp = second_moment[pruned][:, pruned].double()
        error = (w_pruned @ c_pp * w_pruned).sum()
        del c_pp
        if update is not None:  # without one the D terms are zero: no |k| x |k| block is cut for them
            c_kp = second_moment[kept_columns][:, pruned].double()
            error -= 2 * (update @ c_kp * w_pruned).sum()
            del c_kp
            c_kk = second_moment[kept_columns][:, kept_columns].double()  # cut before widening, as in the fit
            error += (update @ c_kk * update).sum()
        return float(error)
    c_kk = second_moment[kept_columns][:, kept_columns].double()
    full = weight.detach().double()
    refitted = full[:, kept_columns] if update is None else full[:, kept_columns] + update
    error = (full @ dense.dense_second_moment.double() * full).sum()
    error -= 2 * (refitted @ dense.cross_moment.double()[:, kept_columns].T * full).sum()
    error += (refitted @ c_kk * refitted).sum()
    return float(error)


@torch.no_grad()
def compensate_linear(
    linear: nn.Linear,
    moment: SecondMoment,
    pruned: list[int],
    damping: float,
    dense: StreamCrossMoment | None = None,
) -> CompensationReport:
    """Add D to the kept columns of `linear` in place; the pruned columns are left for masking to zero.

    With `dense` (the dense stream's statistics) the target is the dense model's output, otherwise this layer's.
    """
    pruned_set = set(pruned)
    kept_columns = [i for i in range(linear.in_features) if i not in pruned_set]
    second_moment = moment.second_moment
    reference = SAME_INPUTS if dense is None else DENSE_MODEL
    before = removal_error(linear.weight, second_moment, pruned, kept_columns, None, dense)
    # Against its own unpruned output a layer that loses nothing has nothing to refit; against the dense model's
    # it still does. A layer that keeps nothing has nothing to refit with.
    if (not pruned and dense is None) or not kept_columns:
        return CompensationReport(error_before=before, error_after=before, damping=0.0, reference=reference)
    cross_moment = None if dense is None else dense.cross_moment
    fit = fit_kept_columns(linear.weight, second_moment, pruned, kept_columns, damping, cross_moment)
    after = removal_error(linear.weight, second_moment, pruned, kept_columns, fit.update, dense)
    linear.weight[:, kept_columns] += fit.update.to(linear.weight.dtype)
    return CompensationReport(error_before=before, error_after=after, damping=fit.damping, reference=reference)


def mean_bias(weight: torch.Tensor, mean: torch.Tensor, pruned: list[int]) -> torch.Tensor:
    """b = W_p E[y_p] in float64: what the pruned input columns add to the output, on average."""
    return weight.detach().double()[:, pruned] @ mean.double()[pruned]


@torch.no_grad()
def add_mean_bias(linear: nn.Linear, moment: SecondMoment, pruned: list[int]) -> CompensationReport:
    """FLAP's compensation: add W_p E[y_p] to the bias of `linear` in place, giving it a bias where it has none.

    Every sub-layer gets one, zero where nothing is pruned, so that all layers of the pruned model have the same
    projections. The pruned columns are left for masking to zero; the kept ones are not touched.
    """
    pruned_set = set(pruned)
    kept_columns = [i for i in range(linear.in_features) if i not in pruned_set]
    second_moment = moment.second_moment
    before = removal_error(linear.weight, second_moment, pruned, kept_columns, None)
    bias = mean_bias(linear.weight, moment.mean, pruned)
    if linear.bias is None:
        linear.bias = nn.Parameter(torch.zeros_like(linear.weight[:, 0]))
    linear.bias += bias.to(linear.bias.dtype)
    # E||W_p y_p - b||² = E||W_p y_p||² - 2 bᵀ E[W_p y_p] + ||b||², and E[W_p y_p] = b.
    after = before - float(bias @ bias)
    return CompensationReport(error_before=before, error_after=after, damping=0.0)


def compensate_layer(
    layer: nn.Module,
    geometry: AttentionGeometry,
    pruning: LayerPruning,
    moments: dict[str, SecondMoment],
    compensation: str,
    damping: float,
    dense: dict[str, StreamCrossMoment] | None = None,
) -> tuple[CompensationReport, CompensationReport]:
    """Compensate o_proj over the kept heads' columns and down_proj over the kept channels, before masking.

    `compensation` is MEAN_BIAS_COMPENSATION (FLAP's bias) or a least-squares refit; `dense` holds the dense
    stream's statistics per sub-layer when the refit's target is the dense model's output.
    """
    heads = head_columns(geometry, list(pruning.pruned_heads))
    channels = list(pruning.pruned_channels)
    o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
    if compensation == MEAN_BIAS_COMPENSATION:
        return add_mean_bias(o_proj, moments["attn"], heads), add_mean_bias(down_proj, moments["mlp"], channels)
    dense = dense or {}
    attn = compensate_linear(o_proj, moments["attn"], heads, damping, dense.get("attn"))
    mlp = compensate_linear(down_proj, moments["mlp"], channels, damping, dense.get("mlp"))
    return attn, mlp
