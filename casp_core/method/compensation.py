"""Compensation: refit the kept input columns of o_proj and down_proj by least squares, or FLAP's mean bias.

A sub-layer computes W y with W its weight (out x d_in) and y its input. Pruning the columns p of W leaves
W_k y_k, which misses W_p y_p. The best linear stand-in for the missing part, in expectation over the
calibration tokens, is W_p y_p ≈ D y_k with

    D = W_p C_pk C_kk^-1,   C = E[y yᵀ] (the statistics CASP already has),

so the kept columns become W_k + D (SparseGPT, ZipLM and SlimGPT make updates of this kind; the CASP paper
leaves the kept weights as they were). C_kk is damped by λ = `damping` x the mean diagonal of the whole C (of
the sub-layer, whatever is kept: the same λ for every pruned set of it) and solved by Cholesky in float64; when
it is still not positive definite the damping grows tenfold (with a warning) until it is.

Several pruned sets of one sub-layer that nest (a dense-mode sweep's ratios, when the solver's choices at the
larger ratios contain those at the smaller, as greedy's do) share one factor (`NestedRefit`): with the columns
ordered so that every kept set is a leading block, the Cholesky factor of C_kk + λI is the leading block of the
factor of the whole C + λI, and each set's solve starts from the next smaller set's.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from casp_core.method.calibration import SecondMoment, StreamCrossMoment
from casp_core.method.surgery import LayerPruning, head_columns
from casp_core.model import AttentionGeometry
from casp_core.settings import MEAN_BIAS_COMPENSATION

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
    damping: float  # relative to the mean diagonal of C, as finally used (0.0 when nothing was refitted)
    reference: str = SAME_INPUTS  # SAME_INPUTS or DENSE_MODEL


@dataclass
class LeastSquaresFit:
    update: torch.Tensor  # D, float64 (out x |k|), to add to the kept columns
    damping: float
    error_before: float  # the expected squared output error of the kept columns as they were
    error_after: float  # ... and with D added
    # The kept column each of D's columns goes to; None: the kept columns in ascending order. A shared refit leaves
    # D in its own column order: putting it in ascending order would copy it once more, for each ratio.
    columns: torch.Tensor | None = None


def fit_kept_columns(
    weight: torch.Tensor,
    second_moment: torch.Tensor,
    pruned: list[int],
    kept_columns: list[int],
    damping: float,
    dense: StreamCrossMoment | None = None,
) -> LeastSquaresFit:
    """D = N (C_kk + λI)^-1 with λ = damping x mean diag(C), in float64 by Cholesky, and the errors before
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
    """The Cholesky factor of C_kk + λI, λ = `damping` x mean diag(C), the damping grown tenfold (with a
    warning) until C_kk + λI is positive definite; with the relative damping used and λ itself."""
    # Cut from C before it is widened to float64: a float64 copy of the whole C (and an identity beside C_kk)
    # would be the largest thing this layer allocates, the size of a layer's weights at 7B. Damped on its own
    # diagonal: no second |k| x |k| matrix.
    c_kk = second_moment[kept_columns][:, kept_columns].double()
    diagonal = c_kk.diagonal().clone()
    scale = damping_scale(second_moment)
    for growth in range(MAX_DAMPING_GROWTH + 1):
        used = damping * 10**growth
        c_kk.diagonal().copy_(diagonal + used * scale)
        factor, info = torch.linalg.cholesky_ex(c_kk)
        if int(info) == 0:
            return factor, used, used * scale
        logger.warning("C_kk is not positive definite with damping %.3g; retrying with %.3g", used, used * 10)
    raise torch.linalg.LinAlgError(f"C_kk stays singular up to damping {used:.3g}")


# Columns per step of the products with the triangular factor and of the solves through its leading blocks: a
# product reads only the factor's rows at or below its columns (about half a dense product), and a solve goes one
# band at a time through views of the factor (a leading block of it is no contiguous matrix: a solver would copy it,
# up to the size of the factor).
TRIANGULAR_BAND = 512


@dataclass
class NestedRefit:
    """The least-squares refits of one sub-layer for several pruned sets that nest (each contains the smaller
    ones), from one Cholesky factor: what `fit_kept_columns` gives for each, to float rounding.

    The columns are put in an order (P) where every set's kept columns come first: the columns kept in every set,
    then those pruned in fewer sets before those pruned in more. With M = P (C + λI) Pᵀ = L Lᵀ (λ the same for
    every set: `damping_scale`) and A = W Pᵀ, a set keeping the first k columns has M_kk = L_kk L_kkᵀ, L_kk the
    leading block of L. The refitted kept columns W' = W_k + D satisfy the normal equations
    W' M_kk = W_k M_kk + W_p C_pk = (A M)_:k, and (A M)_:k = (A L)_:k L_kkᵀ since L is lower triangular, so

        W' = (A L)_:k L_kk^-1,   D = W' - W_k,

    one product G = A L for all the sets, and the solves through nested leading blocks (`_nested_solves`). The
    errors:

        after  = E||W_p y_p - D y_k||² = ||G_:,k:||² - λ (||W_p||² + ||D||²)
        before = E||W_p y_p||² = sum of (A_pᵀ A_p) ⊙ C_pp,

    the first from expanding E||W y - W' y_k||² with C = M - λI and W' L_kk = G_:k; the second is z'Qz over the
    pruned columns, for every set from one pass over the largest set's columns (`_nested_errors_before`).
    Every set's fit is made at once, since each solve starts from the next smaller set's."""

    order: torch.Tensor  # P as column numbers: position i holds column order[i]
    fits: dict[int, LeastSquaresFit]  # by the number of kept columns

    @classmethod
    def of(
        cls, weight: torch.Tensor, second_moment: torch.Tensor, pruned_sets: Sequence[list[int]], damping: float
    ) -> "NestedRefit | None":
        """The shared factor's fits for `pruned_sets`, or None where it does not apply and each set is fitted on
        its own: fewer than two sets to refit (one that prunes something and keeps something), sets that do not
        nest, or C + λI not positive definite at the damping asked (each C_kk + λI then grows its damping as it
        needs)."""
        width = second_moment.shape[0]
        refitted = {frozenset(pruned) for pruned in pruned_sets if 0 < len(pruned) < width}
        if len(refitted) < 2:
            return None
        times_pruned = torch.zeros(width, dtype=torch.int64)
        for pruned in pruned_sets:
            times_pruned[pruned] += 1
        order = torch.sort(times_pruned, stable=True).indices
        if any(set(order[width - len(pruned) :].tolist()) != set(pruned) for pruned in pruned_sets):
            return None  # some set is not the last columns of the order: the sets do not nest
        scale = damping_scale(second_moment)
        ordered = weight.detach()[:, order].double()
        moment = second_moment[order[:, None], order].double()  # one gather, not a row copy and then its columns
        kept_counts = sorted(width - len(pruned) for pruned in refitted)
        errors_before = _nested_errors_before(ordered, moment, kept_counts)
        moment.diagonal().add_(damping * scale)
        factor, info = torch.linalg.cholesky_ex(moment)
        del moment
        if int(info) != 0:
            return None
        product = _times_lower_triangular(ordered, factor)
        tail_energy = _tail_sums((product * product).sum(dim=0))
        tail_weight = _tail_sums((ordered * ordered).sum(dim=0))
        ridge = damping * scale
        fits = {}
        for kept, refitted_columns in _nested_solves(product, factor, kept_counts):
            update = refitted_columns - ordered[:, :kept]
            update_energy = float(torch.linalg.vector_norm(update).square())
            fits[kept] = LeastSquaresFit(
                update=update,
                damping=damping,
                error_before=errors_before[kept],
                error_after=float(tail_energy[kept]) - ridge * (float(tail_weight[kept]) + update_energy),
                columns=order[:kept],
            )
        return cls(order, fits)

    def fit(self, pruned: list[int]) -> LeastSquaresFit:
        """`fit_kept_columns`' fit for `pruned` (one of the sets this was made for), its update's columns in the
        nested order (`columns`)."""
        kept = len(self.order) - len(pruned)
        assert kept in self.fits and set(self.order[kept:].tolist()) == set(pruned), "not one of its sets"
        return self.fits[kept]


def _nested_solves(rhs: torch.Tensor, lower: torch.Tensor, widths: list[int]) -> Iterator[tuple[int, torch.Tensor]]:
    """X_k with X_k L_kk = rhs_:k for each k of `widths` (ascending), L_kk the leading k x k block of the
    lower-triangular `lower`: each from the one before rather than solved whole. For j < k, with
    L_kk = [[L_jj, 0], [B, L_bb]] (B the rows j..k below L_jj), X_k = [X_j - X_b T, X_b], where X_b L_bb = rhs_:,j:k
    and T L_jj = B: T has k - j rows where a whole solve has one per output row, about half the work at a sweep's
    steps of 0.1 (the same X to float rounding). Each X_k is a view of one buffer, good until the next is made."""
    solution, done = rhs.new_empty(rhs.shape[0], widths[-1]), 0
    for width in widths:
        band = solution[:, done:width]
        band.copy_(_solve_times_lower_triangular(rhs[:, done:width], lower[done:width, done:width]))
        if done:
            coupling = _solve_times_lower_triangular(lower[done:width, :done], lower[:done, :done])
            solution[:, :done].addmm_(band, coupling, alpha=-1)
        done = width
        yield width, solution[:, :width]


def _nested_errors_before(ordered: torch.Tensor, moment: torch.Tensor, kept_counts: list[int]) -> dict[int, float]:
    """E||A_p y_p||² = the sum of (A_pᵀ A_p) ⊙ C_pp over the columns from k on, for each k of `kept_counts`
    (ascending), A and C in the nested order. The columns from the first k on fall into bands between the counts;
    each band's rows are multiplied with the columns of its own band and the later ones only, and the sums over
    the block pairs give every k's (the matrix is symmetric: about 60 % of the whole |p| x |p| product at six
    even steps)."""
    bounds = [*kept_counts, ordered.shape[1]]
    bands = len(kept_counts)
    block_sums = torch.zeros(bands, bands, dtype=torch.float64)
    for i in range(bands):
        rows, start = slice(bounds[i], bounds[i + 1]), bounds[i]
        part = (ordered[:, rows].T @ ordered[:, start:]).mul_(moment[rows, start:])
        for j in range(i, bands):
            block_sums[i, j] = part[:, bounds[j] - start : bounds[j + 1] - start].sum()
    pairs = block_sums + block_sums.triu(1).T  # each off-diagonal block counted from both sides
    return {kept: float(pairs[i:, i:].sum()) for i, kept in enumerate(kept_counts)}


def _tail_sums(values: torch.Tensor) -> torch.Tensor:
    """tail[j] = the sum of values[j:], for j = 0 .. len(values) (the last 0)."""
    return torch.cat([values.flip(0).cumsum(0).flip(0), values.new_zeros(1)])


def _times_lower_triangular(matrix: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """matrix @ lower for a lower-triangular `lower`, a band of columns at a time over the rows that are not zero."""
    width = lower.shape[1]
    product = matrix.new_empty(matrix.shape[0], width)
    for start in range(0, width, TRIANGULAR_BAND):
        stop = min(start + TRIANGULAR_BAND, width)
        product[:, start:stop] = matrix[:, start:] @ lower[start:, start:stop]
    return product


def _solve_times_lower_triangular(rhs: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """X with X @ lower = rhs for a lower-triangular `lower` (a view), by bands from the last: band j of X solves
    X_j L_jj = rhs_j - sum over later bands i of X_i L_ij, and each band solved is taken off the earlier ones."""
    solution = rhs.clone()
    for start in reversed(range(0, lower.shape[1], TRIANGULAR_BAND)):
        stop = min(start + TRIANGULAR_BAND, lower.shape[1])
        band = torch.linalg.solve_triangular(
            lower[start:stop, start:stop], solution[:, start:stop], upper=False, left=False
        )
        solution[:, start:stop] = band
        solution[:, :start].addmm_(band, lower[start:stop, :start], alpha=-1)
    return solution


def damping_scale(second_moment: torch.Tensor) -> float:
    """What the relative damping multiplies: the mean diagonal of the sub-layer's whole C, in float64.

    Not C_kk's: a λ that depended on the kept set would differ between the pruned sets of one sub-layer, and
    `NestedRefit` serves them all from one factor of C + λI."""
    return float(second_moment.diagonal().double().mean().clamp(min=torch.finfo(torch.float64).tiny))


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
    refit: NestedRefit | None = None,
) -> CompensationReport:
    """Add D to the kept columns of `linear` in place; the pruned columns are left for masking to zero.

    With `dense` (the dense stream's statistics) the target is the dense model's output, otherwise this layer's.
    `refit`, made for `pruned` among other sets of this sub-layer's, gives the fit from its shared factor.
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
    if refit is not None:
        assert dense is None, "the shared factor refits towards the layer's own output"
        fit = refit.fit(pruned)
    else:
        fit = fit_kept_columns(linear.weight, second_moment, pruned, kept_columns, damping, dense)
    linear.weight[:, kept_columns if fit.columns is None else fit.columns] += fit.update.to(linear.weight.dtype)
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


@dataclass(frozen=True)
class SharedRefits:
    """One layer's `NestedRefit` per sub-layer, None where its sets are fitted one by one."""

    attn: NestedRefit | None
    mlp: NestedRefit | None


def compensate_layer(
    layer: nn.Module,
    geometry: AttentionGeometry,
    pruning: LayerPruning,
    moments: dict[str, SecondMoment],
    compensation: str,
    damping: float,
    dense: dict[str, StreamCrossMoment] | None = None,
    refits: SharedRefits | None = None,
) -> tuple[CompensationReport, CompensationReport]:
    """Compensate o_proj over the kept heads' columns and down_proj over the kept channels, before masking.

    `compensation` is MEAN_BIAS_COMPENSATION (FLAP's bias) or a least-squares refit; `dense` holds the dense
    stream's statistics per sub-layer when the refit's target is the dense model's output; `refits`, the
    factors this pruning shares with others of the layer (`shared_refits`).
    """
    heads = head_columns(geometry, list(pruning.pruned_heads))
    channels = list(pruning.pruned_channels)
    o_proj, down_proj = layer.self_attn.o_proj, layer.mlp.down_proj
    if compensation == MEAN_BIAS_COMPENSATION:
        return add_mean_bias(o_proj, moments["attn"], heads), add_mean_bias(down_proj, moments["mlp"], channels)
    dense, refits = dense or {}, refits or SharedRefits(None, None)
    attn = compensate_linear(o_proj, moments["attn"], heads, damping, dense.get("attn"), refits.attn)
    mlp = compensate_linear(down_proj, moments["mlp"], channels, damping, dense.get("mlp"), refits.mlp)
    return attn, mlp


def shared_refits(
    layer: nn.Module,
    geometry: AttentionGeometry,
    prunings: Sequence[LayerPruning],
    moments: dict[str, SecondMoment],
    damping: float,
) -> SharedRefits:
    """The least-squares refits of o_proj and down_proj that several prunings of one layer, on the same
    statistics, can share (a dense-mode sweep's ratios): `NestedRefit.of` for each sub-layer's pruned sets."""
    heads = [head_columns(geometry, list(pruning.pruned_heads)) for pruning in prunings]
    channels = [list(pruning.pruned_channels) for pruning in prunings]
    return SharedRefits(
        NestedRefit.of(layer.self_attn.o_proj.weight, moments["attn"].second_moment, heads, damping),
        NestedRefit.of(layer.mlp.down_proj.weight, moments["mlp"].second_moment, channels, damping),
    )
