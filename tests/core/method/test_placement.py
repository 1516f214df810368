"""Placement: offloaded, a whole prune keeps one decoder layer at a time on the device in every stage and leaves
nothing there; resident, the model goes there once; auto picks by the memory model and the limit; a limit too
small for one layer is refused before any work. The memory model counts the weights a checkpoint has."""

import argparse

import pytest
import torch

from casp_core.cli.setting_flags import add_setting_flags, settings_from_args
from casp_core.errors import DeviceMemoryTooSmall, InvalidConfig
from casp_core.job.run import run_job
from casp_core.method import allocation
from casp_core.method import placement as placement_module
from casp_core.method.calibration import CalibrationPlan, calibration_windows
from casp_core.method.placement import (
    OFFLOAD,
    RESIDENT,
    JobShape,
    ModelShape,
    PlacementPlan,
    choose_placement,
    estimate_device_memory,
)
from casp_core.method.prune import prune
from casp_core.model import decoder_layers, load_model
from casp_core.report.build import build_report, pruning_section, render_markdown
from casp_core.run import Run
from casp_core.settings import CalibrationConfig, PruneConfig
from tests.conftest import PTBWIKI, STORIES, small_config
from tests.core.device_placement import OTHER_DEVICE, DevicePlacement
from tests.core.method.test_surgery import tiny_llama

PIPELINE_STAGES = ("allocation", "calibration_forward", "statistics", "solver", "compensation", "surgery")
PIPELINE_STAGES += ("verification",)
LLAMA2_7B = ModelShape(
    hidden=4096,
    intermediate=11008,
    heads=32,
    kv_heads=32,
    head_dim=128,
    layers=32,
    vocab=32000,
    tied_head=False,
    dtype_bytes=2,
    eager_attention=False,
)


def on_the_device(**overrides) -> PruneConfig:
    return small_config(0.3, device=str(OTHER_DEVICE), **overrides)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"alpha": "auto"}, {"compensation": "least_squares_dense_target"}],
    ids=["gradient", "alpha_auto", "dense_target"],
)
def test_offloaded_prune_keeps_one_decoder_layer_on_the_device_in_every_stage(stories, monkeypatch, overrides):
    model, tokenizer = stories
    config = on_the_device(placement="offload", **overrides)
    windows = calibration_windows(tokenizer, CalibrationPlan.of(config, model.config))
    recorder = DevicePlacement(model, OTHER_DEVICE, monkeypatch)
    events = []
    run = recorder.run()
    run.progress = lambda stage, fraction, message="": events.append((stage, message))
    result = prune(model, tokenizer, config, run, windows=windows)

    assert recorder.offload_violations() == []
    began = {snapshot.stage for snapshot in recorder.snapshots if snapshot.event == "begin"}
    assert set(PIPELINE_STAGES) <= began
    # Layers ran in each stage that runs them, each time alone on the device (verification: float64 copies).
    assert {"allocation", "statistics", "calibration_forward", "verification"} <= recorder.stages_with_runs()
    layers = len(decoder_layers(model))
    in_stage = [s.layer for s in recorder.snapshots if s.event == "run" and s.stage == "allocation"]
    # Forward 0..4 and the backward's recomputation 4..1, per chunk of windows (of one here: one window's layer
    # inputs are the host's share for this tiny model); alpha "auto" adds one pass of the 12 statistics windows and
    # one of the held-out windows per temperature, through every layer.
    assert allocation.windows_per_chunk(model, windows, config.calibration.batch_size) == 1
    gradient_runs = ([*range(layers), *range(layers - 1, 0, -1)]) * len(windows)
    assert in_stage[: len(gradient_runs)] == gradient_runs
    if "alpha" in overrides:
        assert len(in_stage) == len(gradient_runs) + layers * (2 * 1 + 6 * 1)  # one batch each
        assert result.temperature is not None
    else:
        assert len(in_stage) == len(gradient_runs)
    assert result.placement is not None and result.placement.mode == OFFLOAD
    assert result.placement.home == torch.device("cpu")
    assert ("placement", result.placement.message()) in events
    assert result.placement.message().startswith("offload, one decoder layer at a time on cpu:0")
    # The head comes for the gradient at the top of each chunk, and for alpha "auto"'s held-out losses.
    assert recorder.arrivals["head"] == len(windows) + ("alpha" in overrides)


def test_offloaded_and_cpu_prune_alike(stories):
    model, tokenizer = stories
    on_cpu = prune(model, tokenizer, small_config(0.3))
    offloaded = prune(load_model(str(STORIES))[0], tokenizer, on_the_device(placement="offload"))
    assert [layer.pruning for layer in offloaded.layers] == [layer.pruning for layer in on_cpu.layers]
    assert offloaded.verification_max_relative_diff == on_cpu.verification_max_relative_diff


def test_resident_prune_moves_the_model_to_the_device_once(stories, monkeypatch):
    model, tokenizer = stories
    recorder = DevicePlacement(model, OTHER_DEVICE, monkeypatch)
    result = prune(model, tokenizer, on_the_device(placement="resident", max_device_memory="1GiB"), recorder.run())
    layers = [f"layer {i}" for i in range(len(decoder_layers(model)))]
    # The embedding comes back for verification's float64 inputs (the model back on the host by then).
    assert dict(recorder.arrivals) == {**dict.fromkeys([*layers, "norm", "head"], 1), "embedding": 2}
    runs = [s for s in recorder.snapshots if s.event == "run" and s.stage != "verification"]
    assert runs and all(snapshot.layers() == set(layers) for snapshot in runs)
    # Back once after the last layer: surgery and verification start from the host, and nothing is left there.
    assert all(not s.on_device for s in recorder.snapshots if s.stage in ("surgery", "verification"))
    assert recorder.on_device == set()
    assert result.placement is not None and result.placement.mode == RESIDENT
    assert result.placement.home == OTHER_DEVICE


def test_auto_is_resident_when_the_estimate_fits_and_offload_below(monkeypatch):
    model, _ = load_model(str(PTBWIKI))  # 8 layers: one layer's working set is well below the model's weights
    calibration = CalibrationConfig(dataset="wikitext2:validation", n_samples=16, seq_len=32, batch_size=1)
    estimate = choose_placement(
        model, PlacementPlan.of(on_the_device(calibration=calibration), model.config), OTHER_DEVICE
    ).estimate
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert estimate.model_weights == model_bytes
    assert estimate.offload_peak < model_bytes < estimate.resident_peak

    def chosen(limit: int | None) -> str:
        config = on_the_device(max_device_memory=limit, calibration=calibration)
        return choose_placement(model, PlacementPlan.of(config, model.config), OTHER_DEVICE).mode

    assert chosen(model_bytes - 1) == OFFLOAD
    assert chosen(estimate.resident_peak - 1) == OFFLOAD
    assert chosen(estimate.resident_peak) == RESIDENT
    assert chosen(None) == OFFLOAD  # a device that cannot say what it has free: the safe choice
    # Without a limit, one that can say what it has free (CUDA) is judged by that.
    monkeypatch.setattr(placement_module, "device_free_memory", lambda device: estimate.resident_peak)
    assert chosen(None) == RESIDENT
    on_cpu = choose_placement(
        model, PlacementPlan.of(small_config(0.3, max_device_memory=1), model.config), torch.device("cpu")
    )
    assert chosen(estimate.offload_peak) == OFFLOAD
    assert (on_cpu.mode, on_cpu.home, on_cpu.limit) == (RESIDENT, torch.device("cpu"), None)  # nothing to offload


def test_a_limit_below_one_layers_working_set_is_refused_before_any_work(stories, monkeypatch):
    model, tokenizer = stories
    estimate = choose_placement(
        model, PlacementPlan.of(on_the_device(placement="offload"), model.config), OTHER_DEVICE
    ).estimate
    recorder = DevicePlacement(model, OTHER_DEVICE, monkeypatch)
    too_small = r"^max_device_memory: [\d.]+ MiB on cpu:0 is less than the estimated [\d.]+ MiB pruning needs with one "
    with pytest.raises(DeviceMemoryTooSmall, match=too_small) as error:
        prune(model, tokenizer, on_the_device(max_device_memory=estimate.offload_peak - 1), recorder.run())
    assert error.value.code == "device_memory_too_small"
    assert recorder.snapshots == [] and recorder.arrivals == {}  # nothing began, nothing moved
    assert choose_placement(
        model, PlacementPlan.of(on_the_device(max_device_memory=estimate.offload_peak), model.config), OTHER_DEVICE
    ).mode == (OFFLOAD)
    with pytest.raises(DeviceMemoryTooSmall, match="with the whole model resident"):
        choose_placement(
            model,
            PlacementPlan.of(
                on_the_device(placement="resident", max_device_memory=estimate.resident_peak - 1), model.config
            ),
            OTHER_DEVICE,
        )


def test_placement_is_in_the_report(stories):
    model, tokenizer = stories
    result = prune(model, tokenizer, on_the_device(max_device_memory="1GiB"))
    report = build_report(
        model_name="stories260K",
        config=on_the_device(max_device_memory="1GiB"),
        pruning=pruning_section(result),
        perplexity={},
        device="cpu:0",
        dtype="float32",
    )
    placement = report["placement"]
    assert (placement["mode"], placement["limit_bytes"]) == (RESIDENT, 2**30)
    assert placement["resident_peak"] == result.placement.estimate.resident_peak
    estimate = result.placement.estimate
    resident, offloaded = estimate.resident_peak / 2**20, estimate.offload_peak / 2**20
    line = f"- device cpu:0 (resident: estimated peak {resident:.1f} MiB resident, {offloaded:.1f} MiB offloaded; "
    assert line + "1.00 GiB allowed), dtype float32" in render_markdown(report)


def test_memory_model_counts_llama2_7b():
    assert LLAMA2_7B.layer_parameters() == 202_383_360
    assert LLAMA2_7B.model_parameters() == 6_738_415_616  # the published parameter count
    job = JobShape(batch_size=8, seq_len=2048, gradient_allocation=True, alpha_auto=False, dense_target=False)
    estimate = estimate_device_memory(LLAMA2_7B, job)
    assert estimate.layer_weights == 2 * 202_383_360
    # The head's stage: the head, one chunk of tokens' float32 logits three times over (64 MiB of logits: 524
    # tokens of this vocabulary), one batch's hidden states and their gradient.
    tokens = 8 * 2048
    assert estimate.head_stage == (32000 + 1) * 4096 * 2 + 3 * 524 * 32000 * 4 + 2 * tokens * 4096 * 2
    # One layer's working set is led by the down_proj statistics: C and Q of 11008 x 11008 in float32, C_kk and
    # its factor in float64, one batch's rows of the widest input in float32.
    activations = tokens * (3 * 4096 + 3 * 4096 + 4096 + 3 * 11008) * 2
    statistics = 2 * 4096**2 * 8 + tokens * 4096 * 8 + 2 * 11008**2 * 4 + tokens * 11008 * 4
    assert estimate.layer_working_set == activations + statistics + 2 * 11008**2 * 8
    assert estimate.offload_peak == max(estimate.layer_weights + estimate.layer_working_set, estimate.head_stage)
    # Resident, the largest stage is one layer's working set beside the whole model.
    assert estimate.resident_peak == estimate.model_weights + estimate.layer_working_set
    assert estimate.model_weights == 2 * 6_738_415_616


@pytest.mark.parametrize(
    ("given", "expected"), [("24GiB", 24 * 2**30), ("500MB", 500_000_000), ("1.5 GB", 1_500_000_000), (4096, 4096)]
)
def test_max_device_memory_takes_bytes_with_units(given, expected):
    assert on_the_device(max_device_memory=given).max_device_memory == expected
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    args = parser.parse_args(["--max-device-memory", str(given), "--placement", "offload"])
    assert settings_from_args(args) == {"max_device_memory": expected, "placement": "offload"}


@pytest.mark.parametrize("given", ["24 parsecs", "GiB", "-1GB", 0, 1.5, ""])
def test_max_device_memory_refuses_what_is_not_a_size(given):
    with pytest.raises(InvalidConfig) as error:
        on_the_device(max_device_memory=given)
    assert error.value.message == (
        f"max_device_memory: must be a number of bytes > 0, or one with a unit such as 24GiB or 500MB, got {given}"
    )
    with pytest.raises(InvalidConfig, match=r"^placement: must be one of auto, resident, offload, got 'gpu'$"):
        on_the_device(placement="gpu")


def test_a_job_records_its_placement(tmp_path):
    events = []
    run = Run(progress=lambda stage, fraction, message="": events.append((stage, message)))
    report = run_job(str(STORIES), on_the_device(placement="offload", max_device_memory="1GiB"), tmp_path / "out", run)
    placement = report["placement"]
    assert (placement["mode"], placement["device"], placement["limit_bytes"]) == (OFFLOAD, "cpu:0", 2**30)
    assert 0 < placement["offload_peak"] < placement["resident_peak"]
    messages = [message for stage, message in events if stage == "placement"]
    assert len(messages) == 1 and messages[0].startswith("offload, one decoder layer at a time on cpu:0")
    assert "- device cpu:0 (offload: estimated peak" in (tmp_path / "out" / "report.md").read_text()


def test_a_job_refuses_too_small_a_limit_before_evaluating(tmp_path):
    stages = []
    run = Run(progress=lambda stage, fraction, message="": stages.append(stage))
    with pytest.raises(DeviceMemoryTooSmall):
        run_job(str(STORIES), on_the_device(max_device_memory="100KiB"), tmp_path / "out", run)
    assert set(stages) == {"load"}  # refused as soon as the model was loaded
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_free_memory_of_a_cuda_device_counts_what_torch_holds_in_reserve(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 2 * 2**30)
    assert placement_module.device_free_memory(torch.device("cuda", 0)) == 6 * 2**30
    assert placement_module.device_free_memory(OTHER_DEVICE) is None


@pytest.mark.parametrize("placement", [OFFLOAD, RESIDENT])
def test_a_random_model_with_its_own_head_and_grouped_heads(monkeypatch, placement):
    """Untied: the head and the embedding are separate weights, each on the device only while it is used."""
    model = tiny_llama(heads=6, kv_heads=2, layers=4, seed=1)  # untied head, grouped key/value heads
    assert not model.config.tie_word_embeddings
    windows = torch.randint(0, 97, (10, 24), generator=torch.Generator().manual_seed(0))
    recorder = DevicePlacement(model, OTHER_DEVICE, monkeypatch)
    config = on_the_device(placement=placement, max_device_memory="1GiB", alpha="auto")
    result = prune(model, None, config, recorder.run(), windows=windows)
    assert result.placement.mode == placement
    if placement == OFFLOAD:
        assert recorder.offload_violations() == []
        # The allocation goes in four chunks of windows here, fewer than a batch each (the embedding and the head
        # once each), alpha "auto" takes first layer inputs twice and the head once, then the pruning loop and
        # verification the embedding.
        assert allocation.windows_per_chunk(model, windows, 8) == 3
        assert (recorder.arrivals["embedding"], recorder.arrivals["head"]) == (4 + 2 + 1 + 1, 4 + 1)
    else:
        assert all(count == 1 for part, count in recorder.arrivals.items() if part != "embedding")
    assert recorder.on_device == set()
