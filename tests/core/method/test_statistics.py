"""Streamed activation statistics: C = E[yᵀy] and E[y], float64 up to FLOAT64_MAX_DIM, float32 beyond."""

import pytest
import torch
from torch import nn

from casp_core.method.calibration import FLOAT64_MAX_DIM, SecondMoment, record_inputs
from casp_core.method.interaction import interaction_matrix

WIDE = FLOAT64_MAX_DIM + 4


def activations(dim: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Four batches of (2, 16, dim) with a common offset, as real activations have: the hard case for float32."""
    generator = torch.Generator().manual_seed(seed)
    offset = torch.randn(dim, generator=generator, dtype=torch.float64) * 3.0
    return [(torch.randn(2, 16, dim, generator=generator, dtype=torch.float64) + offset).to(dtype) for _ in range(4)]


def reference(batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.cat([batch.reshape(-1, batch.shape[-1]).double() for batch in batches])
    return rows.T @ rows / rows.shape[0], rows.mean(dim=0)


def test_width_decides_the_accumulator_dtype():
    assert SecondMoment(FLOAT64_MAX_DIM, torch.device("cpu")).outer.dtype == torch.float64
    # Beyond it float64 would double the memory of a d x d matrix (11008 wide: 0.97 GB instead of 0.48 GB).
    assert SecondMoment(FLOAT64_MAX_DIM + 1, torch.device("cpu")).outer.dtype == torch.float32


def test_narrow_statistics_are_exact_in_float64():
    batches = activations(48, torch.float32, seed=0)
    moment = SecondMoment(48, torch.device("cpu"))
    for batch in batches:
        moment.update(batch)
    second, mean = reference(batches)
    assert moment.count == 4 * 2 * 16
    torch.testing.assert_close(moment.second_moment, second, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(moment.mean, mean, rtol=1e-12, atol=1e-12)


def test_wide_statistics_accumulate_in_float32_and_match_float64():
    """Through the hook the pipeline uses, on bfloat16 inputs (a half-precision model): within 1e-5 of |C|."""
    linear = nn.Linear(WIDE, 2, bias=False, dtype=torch.bfloat16)
    batches = activations(WIDE, torch.bfloat16, seed=1)
    with torch.no_grad(), record_inputs({"wide": linear}) as moments:
        for batch in batches:
            linear(batch)
    moment = moments["wide"]
    assert moment.second_moment.dtype == torch.float32 and moment.mean.dtype == torch.float32
    assert moment.count == 4 * 2 * 16
    second, mean = reference(batches)
    scale = float(second.abs().max())
    assert float((moment.second_moment.double() - second).abs().max()) <= 1e-5 * scale
    assert float((moment.mean.double() - mean).abs().max()) <= 1e-5 * float(mean.abs().max())
    # Q from the float32 statistics is exactly symmetric, as the solvers assume.
    q = interaction_matrix(torch.randn(3, WIDE, generator=torch.Generator().manual_seed(2)), moment.second_moment)
    assert q.dtype == torch.float32 and torch.equal(q, q.T)


def test_averages_are_taken_in_place_once_and_close_the_statistics():
    """The sums become E[yᵀy] and E[y] in their own storage (no d x d copy), the same on every read; a batch
    arriving after that would be averaged wrongly, so it is refused."""
    batches = activations(48, torch.float64, seed=3)
    moment = SecondMoment(48, torch.device("cpu"))
    for batch in batches:
        moment.update(batch)
    sums = moment.outer.clone(), moment.total.clone()
    second, mean = moment.second_moment, moment.mean
    assert second.data_ptr() == moment.outer.data_ptr() and mean.data_ptr() == moment.total.data_ptr()
    assert torch.equal(second, sums[0] / moment.count) and torch.equal(mean, sums[1] / moment.count)
    assert torch.equal(moment.second_moment, sums[0] / moment.count)  # not divided again
    with pytest.raises(RuntimeError, match="no more inputs"):
        moment.update(batches[0])
