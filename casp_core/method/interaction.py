"""Interaction matrices: Q = (W Wᵀ) ⊙ E[YᵀY], and what is read off them.

`weight` is a torch Linear weight (d x d_m), so the paper's W (one row per input unit) is weight.T and
G = W Wᵀ = weight.T @ weight. The pruning cost of a set S is L(S) = z_Sᵀ Q z_S, the expected squared norm of
the removed part of the sub-layer's output per token.
"""

import torch

SYMMETRISED_ROWS = 512  # rows per step of the in-place symmetrisation: its scratch is this many rows of Q


def interaction_matrix(weight: torch.Tensor, second_moment: torch.Tensor) -> torch.Tensor:
    w = weight.detach().to(second_moment.dtype)
    q = (w.T @ w).mul_(second_moment)
    # Exact symmetry lets the solvers read rows for columns; the two products differ only by rounding.
    return _symmetrise_(q)


def _symmetrise_(q: torch.Tensor) -> torch.Tensor:
    """q <- (q + qᵀ) / 2 in place, a band of rows at a time, rather than through a second d x d matrix.

    Each step settles rows and columns [start, stop) against everything after `start`; what came before is
    already symmetric and is not read again. Addition commutes exactly, so this is (q + qᵀ) * 0.5 bit for bit."""
    size = q.shape[0]
    for start in range(0, size, SYMMETRISED_ROWS):
        stop = min(start + SYMMETRISED_ROWS, size)
        band = (q[start:stop, start:] + q[start:, start:stop].T).mul_(0.5)
        q[start:stop, start:] = band
        q[start:, start:stop] = band.T
    return q


def block_aggregate(q: torch.Tensor, block: int) -> torch.Tensor:
    """Q̃[a, b] = sum of Q over (block a) x (block b): the interaction matrix of attention heads."""
    units = q.shape[0] // block
    return q.view(units, block, units, block).sum(dim=(1, 3))


def offdiag_ratio(q: torch.Tensor) -> float:
    """The paper's rho: the share of |Q| that lies off the diagonal."""
    total = q.abs().sum()
    if total == 0:
        return 0.0
    return float((total - q.diagonal().abs().sum()) / total)


def objective(q: torch.Tensor, indices: torch.Tensor) -> float:
    """z_Sᵀ Q z_S for the unit set S = `indices`."""
    return float(q[indices][:, indices].sum())
