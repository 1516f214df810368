"""Interaction matrices: Q = (W Wᵀ) ⊙ E[YᵀY], and what is read off them.

`weight` is a torch Linear weight (d x d_m), so the paper's W (one row per input unit) is weight.T and
G = W Wᵀ = weight.T @ weight. The pruning cost of a set S is L(S) = z_Sᵀ Q z_S, the expected squared norm of
the removed part of the sub-layer's output per token.
"""

import torch


def interaction_matrix(weight: torch.Tensor, second_moment: torch.Tensor) -> torch.Tensor:
    w = weight.detach().to(second_moment.dtype)
    q = (w.T @ w).mul_(second_moment)
    # Exact symmetry lets the solvers read rows for columns; the two products differ only by rounding.
    return (q + q.T).mul_(0.5)


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
