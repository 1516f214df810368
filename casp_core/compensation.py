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
    error_before: float  # the expected squared output error of the kept columns as they were
    error_after: float  # ... and with D added


def fit_kept_columns(
    weight: torch.Tensor,
    second_moment: torch.Tensor,
    pruned: list[int],
    kept_columns: list[int],
    damping: float,
    dense: StreamCrossMoment | None = None,
) -> LeastSquaresFit:
    """D = N (C_kk + λI)^-1 with λ = damping x mean diag(C_kk), in float64 by Cholesky, and the errors before
    and after (`removal_error`'s, with the undamped moments).

    The numerator N is W_p C_pk against the same layer on the same inputs, and W M_:k - W_k C_kk against the dense
    model (`dense` given, M its cross moment). The error after follows from the one before with no product of
    its own: expanding `removal_error`'s formula with D (for the dense model, W' = W_k + D; C_kk is symmetric)
    gives after = before - 2 <D, N> + tr(D C_kk Dᵀ) for both references, and the normal equations
    D (C_kk + λI) = N make tr(D C_kk Dᵀ) = <D, N> - λ||D||², so

        after = before - <D, N> - λ||D||²   (<A, B> = sum of A ⊙ B).
    """
    weight = weight.detach()
    if dense is None:
        error_before = removal_error(weight, second_moment, pruned, kept_columns)
        w_pruned = weight[:, pruned].double()
        c_kp = second_moment[kept_columns][:, pruned].double()
        numerator = w_pruned @ c_kp.T
    else:
        error_before, numerator = _dense_target(weight, second_moment, kept_columns, dense)
    factor, used, ridge = _damped_cholesky(second_moment, kept_columns, damping)
    out, kept, removed = len(weight), len(kept_columns), len(pruned)
    # D = W_p ((C_kk + λI)^-1 C_kp)ᵀ takes |p| right-hand sides through the factor and one more out x |p| x |k|
    # product; D = N (C_kk + λI)^-1 takes `out` of them. The same D to rounding: the cheaper order (the first at
    # low ratios, where |p| is small).
    if dense is None and removed * (kept + out) < out * kept:
        update = w_pruned @ torch.cholesky_solve(c_kp, factor).T
    else:
        update = torch.cholesky_solve(numerator.T, factor).T
    error_after = error_before - float((update * numerator).sum()) - ridge * float(update.pow(2).sum())
    return LeastSquaresFit(update=update, damping=used, error_before=error_before, error_after=error_after)


def _damped_cholesky(
    second_moment: torch.Tensor, kept_columns: list[int], damping: float
) -> tuple[torch.Tensor, float, float]:
    """The Cholesky factor of C_kk + λI, λ = `damping` x mean diag(C_kk), the damping grown tenfold (with a
    warning) until C_kk + λI is positive definite; with the relative damping used and λ itself."""
    # Cut from C before it is widened to float64: a float64 copy of the whole C (and an identity beside C_kk)
    # would be the largest thing this layer allocates, the size of a layer's weights at 7B. Damped on its own
    # diagonal: no second |k| x |k| matrix.
    c_kk = second_moment[kept_columns][:, kept_columns].double()
    diagonal = c_kk.diagonal().clone()
    scale = float(diagonal.mean().clamp(min=torch.finfo(torch.float64).tiny))
    for growth in range(MAX_DAMPING_GROWTH + 1):
        used = damping * 10**growth
        c_kk.diagonal().copy_(diagonal + used * scale)
        factor, info = torch.linalg.cholesky_ex(c_kk)
        if int(info) == 0:
            return factor, used, used * scale
        logger.warning("C_kk is not positive definite with damping %.3g; retrying with %.3g", used, used * 10)
    raise torch.linalg.LinAlgError(f"C_kk stays singular up to damping {used:.3g}")


def removal_error(
    weight: torch.Tensor,
    second_moment: torch.Tensor,
    pruned: list[int],
    kept_columns: list[int],
    dense: StreamCrossMoment | None = None,
) -> float:
    """The expected squared output error per token of the kept columns as they are (no refit).

    Against the same layer on the same inputs: E||W_p y_p||² = tr(W_p C_pp W_pᵀ). Against the dense model
    (`dense` given): E||W y_d - W_k y_k||² = tr(W C_d Wᵀ) - 2 tr(W_k M_:kᵀ Wᵀ) + tr(W_k C_kk W_kᵀ).
    """
    if dense is not None:
        return _dense_target(weight, second_moment, kept_columns, dense)[0]
    w_pruned = weight.detach()[:, pruned].double()
    c_pp = second_moment[pruned][:, pruned].double()
    return float((w_pruned @ c_pp * w_pruned).sum())


def _dense_target(
    weight: torch.Tensor, second_moment: torch.Tensor, kept_columns: list[int], dense: StreamCrossMoment
) -> tuple[float, torch.Tensor]:
    """Against the dense model: the error of the kept columns as they are, and the refit's numerator
    N = W M_:k - W_k C_kk, from the same two out x |k| products."""
    full = weight.detach().double()
    kept = full[:, kept_columns]
    towards_dense = full @ dense.cross_moment[:, kept_columns].double()  # W M_:k
    kept_output = kept @ second_moment[kept_columns][:, kept_columns].double()  # W_k C_kk
    error = (full @ dense.dense_second_moment.double() * full).sum()
    error += (kept_output * kept).sum() - 2 * (towards_dense * kept).sum()
    return float(error), towards_dense.sub_(kept_output)


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
    # Against its own unpruned output a layer that loses nothing has nothing to refit; against the dense model's
    # it still does. A layer that keeps nothing has nothing to refit with.
    if (not pruned and dense is None) or not kept_columns:
        before = removal_error(linear.weight, second_moment, pruned, kept_columns, dense)
        return CompensationReport(error_before=before, error_after=before, damping=0.0, reference=reference)
    fit = fit_kept_columns(linear.weight, second_moment, pruned, kept_columns, damping, dense)
    linear.weight[:, kept_columns] += fit.update.to(linear.weight.dtype)
    return CompensationReport(
        error_before=fit.error_before, error_after=fit.error_after, damping=fit.damping, reference=reference
    )


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
    before = removal_error(linear.weight, second_moment, pruned, kept_columns)
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
