"""The job's plan: the settings turned once into the typed pieces the stages read (ptbwiki-7M's config alone)."""

import pytest

from casp_core.errors import InvalidDataset
from casp_core.job.plan import plan_job
from casp_core.method.prune import PrunePlan
from casp_core.model import load_config
from casp_core.settings import PruneConfig, RecoveryConfig
from tests.conftest import PTBWIKI


def test_a_single_ratio_is_planned_into_each_stages_piece() -> None:
    """The quantizer's block is decided by the plan (q4_k_m's 256, from the export), the windows are capped at the
    model's context of 512 tokens, and the memory model reads the job's shape: a gradient allocation whose alpha is
    chosen, compensated towards the dense model in sequential calibration."""
    model_config = load_config(str(PTBWIKI))
    settings = PruneConfig(
        ratio=0.3,
        alpha="auto",
        export=["gguf"],
        gguf_type="q4_k_m",
        compensation="least_squares_dense_target",
        calibration={"seq_len": 4096, "n_samples": 4, "batch_size": 8},
        moe={"prune_unreached": True},
        device="cpu",
    )
    plan = plan_job(settings, model_config)
    assert plan.sweep is None and plan.prune is not None
    allocation, calibration, job = plan.prune.allocation, plan.prune.calibration, plan.prune.placement.job
    assert (allocation.ratio, allocation.block, allocation.gguf_type) == (0.3, 256, "q4_k_m")
    assert allocation.alpha_auto and allocation.uses_sensitivities
    assert (calibration.seq_len, calibration.n_samples, calibration.sequential) == (512, 4, True)
    assert (job.batch_size, job.seq_len, job.alpha_auto, job.dense_target) == (4, 512, True, True)
    assert plan.prune.layer.compensates and plan.prune.experts.prune_unreached
    # What a caller of `prune` gets is the same plan, built from the same settings.
    assert PrunePlan.of(settings, model_config) == plan.prune


def test_without_a_quantized_gguf_no_block_is_fitted_and_a_target_plans_its_sweep() -> None:
    model_config = load_config(str(PTBWIKI))
    for gguf_type in ("f16", "bf16"):
        plan = plan_job(PruneConfig(ratio=0.3, export=["gguf"], gguf_type=gguf_type, device="cpu"), model_config)
        assert plan.prune is not None and (plan.prune.allocation.block, plan.prune.allocation.gguf_type) == (None, None)
    unexported = plan_job(PruneConfig(ratio=0.3, gguf_type="q4_k_m", device="cpu"), model_config)
    assert unexported.prune is not None and unexported.prune.allocation.block is None
    swept = plan_job(PruneConfig(target={"max_bytes": 10**9}, ratios=[0.2, 0.4], device="cpu"), model_config)
    assert swept.prune is None and swept.sweep is not None
    assert [candidate.ratio for candidate in swept.sweep.candidates][:1] == [0.2]
    assert swept.sweep.calibration.seq_len == 512 and not swept.sweep.placement.job.alpha_auto


def test_a_sweep_plans_each_candidates_prune_with_the_rounding_its_variant_asks_for() -> None:
    model_config = load_config(str(PTBWIKI))
    settings = PruneConfig(
        target={"max_bytes": 10**9}, ratios=[0.2], export=["gguf"], gguf_types=["f16", "q4_k_m"], device="cpu"
    )
    sweep = plan_job(settings, model_config).sweep
    assert sweep is not None and [(c.ratio, c.variant) for c in sweep.candidates] == [(0.2, "f16"), (0.2, "q4_k_m")]
    f16, q4_k_m = sweep.prune_of(0.2, "f16"), sweep.prune_of(0.2, "q4_k_m")
    assert (f16.allocation.ratio, f16.allocation.block) == (0.2, None)
    assert (q4_k_m.allocation.ratio, q4_k_m.allocation.block, q4_k_m.allocation.gguf_type) == (0.2, 256, "q4_k_m")
    # Everything else the two prunes read is the same, and the sweep's shared calibration and placement.
    assert (f16.calibration, f16.placement, f16.layer) == (q4_k_m.calibration, q4_k_m.placement, q4_k_m.layer)
    assert (f16.calibration, f16.placement) == (sweep.calibration, sweep.placement)


def test_the_stages_after_pruning_are_planned_too() -> None:
    """Evaluation windows of the model's context (512 tokens, under the default's 2048) unless the settings name a
    length; recovery only when asked for, its windows checked against the context; what the checkpoint records of
    the settings, without the machine's paths; no quantized checkpoint unless a scheme is named."""
    model_config = load_config(str(PTBWIKI))
    plain = plan_job(PruneConfig(ratio=0.3, datasets_dir="/data/sets", device="cpu"), model_config)
    evaluation = plain.evaluation
    assert (evaluation.seq_len, evaluation.perplexity, evaluation.texts) == (512, ("wikitext2", "ptb"), {})
    assert plain.recovery is None and plain.artifacts.quantization is None and plain.artifacts.export == ()
    assert "/data/sets" not in str(plain.artifacts.recorded_settings)
    assert plain.artifacts.recorded_settings["ratio"] == 0.3

    settings = PruneConfig(
        ratio=0.3,
        evaluation={"perplexity": ["wikitext2", "ptb"], "seq_len": 128, "limit": 4, "zero_shot": ["piqa"]},
        recovery={"method": "lora", "dataset": "ptb:train", "max_seq_len": 256},
        quantization="w8a8_int8",
        export=["gguf"],
        gguf_type="q8_0",
        device="cpu",
    )
    plan = plan_job(settings, model_config)
    evaluation = plan.evaluation
    assert (evaluation.seq_len, evaluation.max_windows, evaluation.zero_shot) == (128, 4, ("piqa",))
    assert plan.recovery is not None and (plan.recovery.context, plan.recovery.settings.method) == (512, "lora")
    assert (plan.artifacts.export, plan.artifacts.gguf_type, plan.artifacts.quantization) == (
        ("gguf",),
        "q8_0",
        "w8a8_int8",
    )
    too_long = settings.model_copy(update={"recovery": RecoveryConfig(method="lora", max_seq_len=1024)})
    with pytest.raises(InvalidDataset, match=r"^recovery.max_seq_len: windows of 1024 tokens .* context of 512$"):
        plan_job(too_long, model_config)
