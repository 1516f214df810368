"""Budgets as settings (casp_core.settings: ratio or target, ratios, gguf_types, quantizations, keep) and as candidates
(casp_core.job.sweep.candidates), on the fixtures' configs: stories260K (hidden 64: no K-quant fits) and ptbwiki-7M
(hidden 256)."""

from typing import Any

import pytest

from casp_core.errors import InvalidConfig
from casp_core.job.plan import plan_sweep
from casp_core.job.sweep.candidates import DEFAULT_GGUF_TYPES, within_target
from casp_core.model import load_config
from casp_core.settings import DEFAULT_SWEEP_RATIOS, PruneConfig, TargetConfig
from tests.conftest import PTBWIKI, STORIES

GIGABYTE = 10**9


def config(**settings: Any) -> PruneConfig:
    return PruneConfig.from_dict(settings).validate()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({}, "ratio: give ratio or target"),
        ({"ratio": 0.3, "target": {"max_params": 10}}, "ratio: give ratio or target, not both"),
        ({"target": {}}, "target: give exactly one of max_bytes, max_params, max_perplexity_increase, got none"),
        (
            {"target": {"max_params": 10, "max_perplexity_increase": 0.1}},
            "target: give exactly one of max_bytes, max_params, max_perplexity_increase, got max_params, "
            "max_perplexity_increase",
        ),
        ({"target": {"max_params": 10, "format": "gguf"}}, "target.format: only goes with max_bytes"),
        ({"target": {"max_bytes": "6 parsecs"}}, "target.max_bytes: must be a number of bytes > 0"),
        ({"target": {"max_perplexity_increase": -1}}, "target.max_perplexity_increase: must be in (0, 100], got -1"),
        ({"target": {"max_params": 10}, "ratios": []}, "ratios: must not be empty"),
        ({"target": {"max_params": 10}, "ratios": [0.1, 1.0]}, "ratios.1: must be in (0, 1), got 1.0"),
        ({"target": {"max_params": 10}, "ratios": [0.3, 0.1, 0.3]}, "ratios: names 0.3 twice"),
        ({"target": {"max_params": 10}, "ratios": [0.6], "r_max": 0.5}, "ratios: must be at most r_max (0.5), got 0.6"),
        ({"target": {"max_params": 10}, "gguf_types": []}, "gguf_types: must not be empty"),
        ({"target": {"max_params": 10}, "quantizations": ["none", "none"]}, "quantizations: names none twice"),
        ({"target": {"max_params": 10}, "keep": "some"}, "keep: must be one of best, all, got 'some'"),
    ],
)
def test_a_bad_budget_setting_names_the_field(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig) as refused:
        config(**settings)
    assert refused.value.message.startswith(message), refused.value.message


def test_a_ratio_job_is_as_before_and_a_target_job_is_a_sweep() -> None:
    single = config(ratio=0.3)
    assert not single.is_sweep and single.target is None and single.ratios == list(DEFAULT_SWEEP_RATIOS)
    sweep = config(target={"max_bytes": "6GB"})
    assert sweep.is_sweep and sweep.ratio is None
    assert sweep.target == TargetConfig(max_bytes=6 * GIGABYTE, format="gguf")  # gguf unless said otherwise
    assert config(target={"max_params": 10}).target.format is None


def test_a_candidate_config_is_the_single_ratio_job_of_that_candidate() -> None:
    sweep = config(target={"max_bytes": GIGABYTE}, quantization="w8a8_int8", gguf_type="f16", alpha=0.5)
    gguf = sweep.candidate_config(0.4, "gguf", "q4_k_m")
    assert (gguf.ratio, gguf.target, gguf.export, gguf.gguf_type, gguf.quantization) == (
        0.4,
        None,
        ["gguf"],
        "q4_k_m",
        "none",
    )
    assert gguf.alpha == 0.5 and not gguf.is_sweep
    gguf.validate()
    safetensors = config(target={"max_params": 10}, export=[]).candidate_config(0.2, "safetensors", "w8a8_int8")
    assert (safetensors.ratio, safetensors.quantization, safetensors.export) == (0.2, "w8a8_int8", [])
    safetensors.validate()


def test_within_target_reads_the_one_budget() -> None:
    by_bytes = TargetConfig(max_bytes=1000)
    assert within_target(1000, 10**9, by_bytes) and not within_target(1001, 1, by_bytes)
    by_params = TargetConfig(max_params=50)
    assert within_target(10**9, 50, by_params) and not within_target(1, 51, by_params)
    assert within_target(10**12, 10**12, TargetConfig(max_perplexity_increase=0.1))


# Every default type for any hidden size: llama.cpp quantizes any width, with its fallbacks (stories260K's 64).
@pytest.mark.parametrize("model", [STORIES, PTBWIKI])
def test_the_default_sweep_is_every_ratio_in_each_default_type(model) -> None:
    variants = list(DEFAULT_GGUF_TYPES)
    settings = config(target={"max_bytes": 10 * GIGABYTE})
    candidates = list(plan_sweep(load_config(str(model)), settings).candidates)
    assert [(c.ratio, c.variant) for c in candidates] == [(r, v) for r in DEFAULT_SWEEP_RATIOS for v in variants]
    assert {c.format for c in candidates} == {"gguf"}
    # Smaller with each ratio, in every type; the dense points are bigger still.
    for variant in variants:
        sizes = [c.estimated_bytes for c in candidates if c.variant == variant]
        assert sizes == sorted(sizes, reverse=True), (variant, sizes)
    dense = {point.variant: point for point in plan_sweep(load_config(str(model)), settings).dense_points}
    assert list(dense) == variants and {point.ratio for point in dense.values()} == {0.0}
    # But two: stories260K's heads are 8 wide, so a layer that loses a head has an attn_output row of 56, which
    # llama.cpp's K-quants store in F16 where the dense 64 took a 32-block type (Q5_1, Q4_1); at 0.1 and the default
    # alpha, four layers lose one head and little else.
    not_smaller = [(c.ratio, c.variant) for c in candidates if c.estimated_bytes >= dense[c.variant].estimated_bytes]
    assert not_smaller == ([(0.1, "q5_k_m"), (0.1, "q4_k_m")] if model == STORIES else []), not_smaller


def test_a_bytes_budget_leaves_out_what_exceeds_it_and_keeps_the_rest() -> None:
    model_config = load_config(str(PTBWIKI))
    everything = list(plan_sweep(model_config, config(target={"max_bytes": 10 * GIGABYTE})).candidates)
    budget = sorted(c.estimated_bytes for c in everything)[len(everything) // 2]
    kept = list(plan_sweep(model_config, config(target={"max_bytes": budget})).candidates)
    assert kept == [c for c in everything if c.estimated_bytes <= budget]
    assert 0 < len(kept) < len(everything)


def test_the_format_of_a_params_or_perplexity_sweep_follows_the_export() -> None:
    model_config = load_config(str(PTBWIKI))
    for target in ({"max_params": GIGABYTE}, {"max_perplexity_increase": 0.1}):
        gguf = list(plan_sweep(model_config, config(target=target, export=["gguf"], ratios=[0.5])).candidates)
        assert [(c.format, c.variant) for c in gguf] == [("gguf", variant) for variant in DEFAULT_GGUF_TYPES]
        # ptbwiki-7M's 704 FFN channels keep multiples of 8: w4a16's groups of 32 do not fit them.
        safetensors = list(plan_sweep(model_config, config(target=target, ratios=[0.5])).candidates)
        assert [(c.format, c.variant) for c in safetensors] == [("safetensors", "none"), ("safetensors", "w8a8_int8")]
    chosen = config(target={"max_bytes": GIGABYTE, "format": "safetensors"}, quantizations=["fp8_dynamic"])
    assert [c.variant for c in plan_sweep(model_config, chosen).candidates] == ["fp8_dynamic"] * 6


def test_a_params_budget_counts_the_whole_model() -> None:
    model_config = load_config(str(STORIES))
    everything = list(plan_sweep(model_config, config(target={"max_params": GIGABYTE}, ratios=[0.2, 0.5])).candidates)
    dense = plan_sweep(model_config, config(target={"max_params": GIGABYTE})).dense_points[0].estimated_params
    assert dense == 260_032  # stories260K: 4,096 + 5 x 45,312 decoder + 5 x 128 + 64 norm weights, tied head
    for candidate in everything:  # the decoder layers lose about the ratio of their 226,560 parameters
        assert abs((dense - candidate.estimated_params) / 226_560 - candidate.ratio) < 0.03, candidate


@pytest.mark.parametrize(
    ("target", "measure", "unit"),
    [({"max_bytes": 1000}, "estimated_bytes", "bytes"), ({"max_params": 1000}, "estimated_params", "parameters")],
)
def test_an_impossible_budget_names_the_smallest_reachable_size(target, measure, unit) -> None:
    model_config = load_config(str(PTBWIKI))
    roomy = {name: GIGABYTE if name.startswith("max_") else value for name, value in target.items()}
    everything = list(plan_sweep(model_config, config(target=roomy, export=["gguf"])).candidates)
    smallest = min(everything, key=lambda c: getattr(c, measure))
    with pytest.raises(InvalidConfig) as refused:
        plan_sweep(model_config, config(target=target, export=["gguf"]))
    budget = next(iter(target))
    assert refused.value.message == (
        f"target.{budget}: no candidate fits in 1000 {unit}: the smallest reachable is {getattr(smallest, measure)} "
        f"{unit} (ratio {smallest.ratio}, {smallest.variant})"
    )
    assert smallest.ratio == max(DEFAULT_SWEEP_RATIOS)


def test_a_k_quant_is_taken_whatever_the_hidden_size() -> None:
    settings = config(target={"max_bytes": GIGABYTE}, gguf_types=["q5_k_m", "q2_k"], ratios=[0.2])
    candidates = list(plan_sweep(load_config(str(STORIES)), settings).candidates)  # hidden 64: every row falls back
    assert [(c.ratio, c.variant) for c in candidates] == [(0.2, "q5_k_m"), (0.2, "q2_k")]


def test_ratios_whole_units_cannot_reach_are_left_out() -> None:
    # r_max 0.5 caps each layer; the K-quants' FFN blocks of 256 leave ptbwiki-7M's 704 channels only 192 to give
    # within it (and no head whose removal keeps o_proj's rows whole blocks), so 0.5 is out of their reach.
    settings = config(target={"max_bytes": GIGABYTE}, r_max=0.5, ratios=[0.2, 0.5])
    candidates = list(plan_sweep(load_config(str(PTBWIKI)), settings).candidates)
    assert (0.5, "f16") in [(c.ratio, c.variant) for c in candidates]
    assert (0.5, "q4_k_m") not in [(c.ratio, c.variant) for c in candidates]
