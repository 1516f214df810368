"""Solvers: Algorithm 1 exactly, relaxation bounds, refinement, determinism."""

import itertools

import pytest
import torch

from casp_core.method.interaction import objective
from casp_core.method.solvers import (
    QUADRATIC_SOLVERS,
    SOLVER_REGISTRY,
    SubLayerProblem,
    diagonal,
    flap_scores,
    greedy,
    greedy_refine,
    project_capped_simplex,
    relax,
    select_units,
    wanda_sp_scores,
)
from casp_core.settings import SOLVERS


def random_psd(d: int, seed: int, rank: int | None = None) -> torch.Tensor:
    """Like the real Q: a Schur product of two Gram matrices, so PSD with off-diagonal terms of both signs."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(d, rank or d, generator=generator, dtype=torch.float64)
    y = torch.randn(3 * d, d, generator=generator, dtype=torch.float64)
    return (w @ w.T) * (y.T @ y / y.shape[0])


def naive_greedy(q: torch.Tensor, k: int) -> list[int]:
    """Recompute every marginal cost Q_ii + 2 sum_{j in S} Q_ij from scratch at each step."""
    chosen: list[int] = []
    for _ in range(k):
        costs = {i: float(q[i, i] + 2 * sum(q[i, j] for j in chosen)) for i in range(q.shape[0]) if i not in chosen}
        best = min(costs.values())
        chosen.append(min(i for i, c in costs.items() if c == best))
    return chosen


def brute_force(q: torch.Tensor, k: int) -> float:
    return min(objective(q, torch.tensor(s, dtype=torch.long)) for s in itertools.combinations(range(q.shape[0]), k))


@pytest.mark.parametrize("seed", range(5))
def test_greedy_equals_naive_recomputation(seed):
    q = random_psd(24, seed)
    for k in (1, 5, 12, 23):
        assert greedy(q, k).tolist() == naive_greedy(q, k)


@pytest.mark.parametrize("seed", range(6))
def test_relaxation_bound_below_optimum_below_greedy(seed):
    d = 8 + seed  # sizes 8..13, brute force stays cheap
    q = random_psd(d, seed)
    for k in (2, d // 2, d - 2):
        optimum = brute_force(q, k)
        solution = relax(q, k, iterations=2000)
        greedy_value = objective(q, greedy(q, k))
        projected = select_units("relaxation", q, k, weight=q, second_moment=q, mean=q[0], block=1)[0]
        rounding = 1e-12 * abs(optimum)  # the same sum taken in another order
        assert solution.lower_bound <= optimum + rounding
        assert optimum <= greedy_value + rounding
        assert optimum <= objective(q, projected) + rounding
        assert solution.z.sum().item() == pytest.approx(k)
        assert bool(((solution.z >= 0) & (solution.z <= 1)).all())


def test_relaxation_bound_is_tight_on_a_diagonal_matrix():
    q = torch.diag(torch.tensor([5.0, 1.0, 3.0, 2.0, 4.0], dtype=torch.float64))
    solution = relax(q, 2, iterations=3000)
    # The binary optimum is 1 + 2; the relaxation spreads mass, so its bound is lower but close.
    assert solution.lower_bound <= 3.0
    assert solution.lower_bound > 1.0


@pytest.mark.parametrize("seed", range(5))
def test_refinement_never_raises_the_objective(seed):
    q = random_psd(40, seed, rank=6)  # low rank: strong interactions, where greedy leaves room
    for k in (5, 20, 35):
        refined = greedy_refine(q, k)
        assert len(set(refined.tolist())) == k
        assert objective(q, refined) <= objective(q, greedy(q, k)) * (1 + 1e-12)


def test_interactions_change_the_choice():
    # Units 0 and 1 cancel each other: alone each looks costly, together they cost 0.2.
    q = torch.tensor([[2.0, -1.9, 0.0], [-1.9, 2.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    assert diagonal(q, 2).tolist() == [2, 0]
    assert greedy(q, 2).tolist() == [2, 0]  # greedy's first step is myopic here ...
    assert sorted(greedy_refine(q, 2).tolist()) == [0, 1]  # ... and one swap finds the cancelling pair
    assert objective(q, greedy_refine(q, 2)) == pytest.approx(0.2)
    # With one unit already chosen, greedy does follow the interaction.
    assert greedy(q[:2, :2], 2).tolist() == [0, 1]
    q3 = torch.tensor([[1.0, -0.9, 0.0], [-0.9, 1.2, 0.0], [0.0, 0.0, 1.1]], dtype=torch.float64)
    assert greedy(q3, 2).tolist() == [0, 1]
    assert diagonal(q3, 2).tolist() == [0, 2]


def test_ties_go_to_the_lowest_index():
    q = torch.eye(6, dtype=torch.float64)
    for name, solver in QUADRATIC_SOLVERS.items():
        if name != "relaxation":  # the relaxed optimum is uniform on ties; its projection order is not the point
            assert sorted(solver(q, 3).tolist()) == [0, 1, 2], name
    assert diagonal(q, 3).tolist() == [0, 1, 2]


def test_capped_simplex_projection():
    v = torch.tensor([3.0, 0.2, -1.0, 0.5], dtype=torch.float64)
    z = project_capped_simplex(v, 2)
    assert z.sum().item() == pytest.approx(2.0)
    assert z.max() <= 1.0 and z.min() >= 0.0
    assert z[0] == 1.0 and z[2] == 0.0


def test_literature_scores():
    weight = torch.tensor([[1.0, -2.0, 0.0, 1.0], [1.0, 0.0, 0.0, -1.0]], dtype=torch.float64)  # out x in
    second = torch.diag(torch.tensor([4.0, 1.0, 9.0, 1.0], dtype=torch.float64))
    mean = torch.tensor([2.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    assert wanda_sp_scores(weight, second).tolist() == [4.0, 2.0, 0.0, 2.0]
    assert flap_scores(weight, second, mean).tolist() == [0.0, 4.0, 0.0, 2.0]
    assert wanda_sp_scores(weight, second, block=2).tolist() == [6.0, 2.0]


def test_every_configurable_solver_is_registered_and_chooses_k_units():
    assert set(SOLVER_REGISTRY) == set(SOLVERS)
    q = random_psd(8, seed=3)
    second = random_psd(8, seed=4)
    problem = SubLayerProblem(
        q=q,
        weight=torch.eye(8, dtype=torch.float64),
        second_moment=second,
        mean=torch.zeros(8, dtype=torch.float64),
        block=1,
    )
    for name, solver in SOLVER_REGISTRY.items():
        selection = solver(problem, 3)
        assert sorted(set(selection.pruned.tolist())) == sorted(selection.pruned.tolist()), name
        assert len(selection.pruned) == 3, name
        assert (selection.lower_bound is not None) == (name == "relaxation"), name
