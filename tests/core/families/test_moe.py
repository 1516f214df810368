"""The mixtures of experts (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, OLMoE) prune each expert's FFN
channels exactly (casp_core/families/moe.py, casp_core/method/experts.py): chosen channels and the real pipeline give a
checkpoint whose experts keep their own widths and that computes the masked model's logits, in this process and in
a user's fresh one; an expert no calibration token reaches is reported and kept whole unless allowed; what MoE
pruning does not take is refused before any work. With `moe.prune_experts` whole experts go too (the lowest S_e,
their router rows with them) and the checkpoint computes the masked model's logits, the masked model routing as if
the removed experts' logits were -inf."""

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import LlamaConfig, MixtralConfig, OlmoeConfig, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.cli import main as cli
from casp_core.errors import InvalidConfig, UnsupportedExport
from casp_core.families import check_export, family_of
from casp_core.families.modeling.modeling_casp_mixtral import CaspMixtralConfig, CaspMixtralForCausalLM
from casp_core.families.moe import route_to_kept_experts, routed_experts, stacked_expert
from casp_core.job.plan import plan_job
from casp_core.method.budget import AllocationPlan, channel_params, check_reachable, plan_budget
from casp_core.method.experts import (
    ExpertsPlan,
    ExpertTraffic,
    RoutedBatch,
    expert_counts,
    expert_moment,
    lowest_energy_experts,
)
from casp_core.method.placement import (
    FLOAT32,
    OPTIMIZER_STATE,
    JobShape,
    ModelShape,
    estimate_device_memory,
    estimate_recovery_memory,
)
from casp_core.method.surgery import LayerPruning, remove_units
from casp_core.model import decoder_layers, load_config, load_model, sublayer_parameters
from casp_core.recovery.train import recover
from casp_core.report.build import recovery_section
from casp_core.run import Run
from casp_core.settings import LORA_TARGETS, PruneConfig, RecoveryConfig
from tests.core.artifacts.test_generation import lowest_supported_transformers
from tests.core.families.checkpoints import fresh_logits, masked_logits, test_tokens
from tests.core.families.helpers import (
    COMMON,
    assert_computes_the_same,
    masked_copy,
    prune_small,
    small_run_arguments,
    small_training_data,
    write_dense,
    written_and_loaded_back,
)
from tests.core.fresh_process import run_python

EXPERTS, TOP_K, EXPERT_WIDTH = 6, 2, 48
SHARED_WIDTH = 40  # Qwen2-MoE's shared expert: one more expert, of its own width, that every token goes through
REMOVED = 2  # whole experts removed from every layer by moe.prune_experts where a test removes some
TINY = {**COMMON, "num_hidden_layers": 2, "intermediate_size": EXPERT_WIDTH}
# The stories260K tokenizer's <s> and </s>.
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2}


ROUTING = {"num_experts_per_tok": TOP_K}


def mixtral_config() -> MixtralConfig:
    return MixtralConfig(**TINY, **TOKEN_IDS, **ROUTING, num_local_experts=EXPERTS)


# Each family's tiny model, and the class and model type its per-layer checkpoint has. Qwen3-MoE's and OLMoE's
# routers do not renormalise the top-k weights by default; Qwen3-MoE's experts are `moe_intermediate_size` wide.
FAMILIES = {
    "mixtral": (mixtral_config, "CaspMixtralForCausalLM"),
    "qwen2_moe": (
        lambda: Qwen2MoeConfig(
            **TINY,
            **TOKEN_IDS,
            **ROUTING,
            num_experts=EXPERTS,
            moe_intermediate_size=EXPERT_WIDTH,
            shared_expert_intermediate_size=SHARED_WIDTH,
        ),
        "CaspQwen2MoeForCausalLM",
    ),
    "qwen3_moe": (
        lambda: Qwen3MoeConfig(
            **TINY, **TOKEN_IDS, **ROUTING, num_experts=EXPERTS, moe_intermediate_size=EXPERT_WIDTH, head_dim=8
        ),
        "CaspQwen3MoeForCausalLM",
    ),
    "olmoe": (
        lambda: OlmoeConfig(**TINY, **TOKEN_IDS, **ROUTING, pad_token_id=None, num_experts=EXPERTS),
        "CaspOlmoeForCausalLM",
    ),
}


@pytest.fixture(scope="module")
def dense_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    return {name: write_dense(config(), root / name) for name, (config, _) in FAMILIES.items()}


@pytest.fixture(scope="module")
def dense_folder(dense_folders: dict[str, Path]) -> Path:
    """Mixtral's, for what all the families share."""
    return dense_folders["mixtral"]


def write_unreached_mixtral(folder: Path) -> Path:
    """A tiny Mixtral that never sends a token to expert 3: its router row is zero, and experts 0 and 1 (2 and 4)
    have opposite rows, so for every token one of each pair has a positive logit, above expert 3's zero, and top-2
    never reaches it."""
    write_dense(mixtral_config(), folder)
    model, _ = load_model(str(folder))
    with torch.no_grad():
        for layer in decoder_layers(model):
            router = layer.mlp.gate.weight
            router[1], router[4], router[3] = -router[0], -router[2], 0
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def unreached_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_unreached_mixtral(tmp_path_factory.mktemp("unreached") / "mixtral")


@pytest.mark.parametrize("family", FAMILIES)
def test_chosen_channels_prune_exactly(family: str, dense_folders: dict[str, Path], tmp_path: Path) -> None:
    """Channels in the layer's numbering (expert e's channel c is e x width + c): some of expert 0's and 5's in layer
    0, every other channel of experts 1 and 2 in layer 1; each expert keeps its own width."""
    model, tokenizer = load_model(str(dense_folders[family]))
    shared = (EXPERTS * EXPERT_WIDTH + 5,) if family == "qwen2_moe" else ()  # the shared expert's, numbered last
    prunings = [
        LayerPruning((), (0, 3, 7, 5 * EXPERT_WIDTH + 1, *shared)),
        LayerPruning((), tuple(range(EXPERT_WIDTH, 3 * EXPERT_WIDTH, 2))),
    ]
    pruned = remove_units(model, prunings)
    if shared:
        assert pruned.config.layer_shared_expert_intermediate_sizes == [SHARED_WIDTH - 1, SHARED_WIDTH]
    assert type(pruned).__name__ == FAMILIES[family][1]
    half = EXPERT_WIDTH // 2
    assert pruned.config.layer_expert_intermediate_sizes == [
        [EXPERT_WIDTH - 3, EXPERT_WIDTH, EXPERT_WIDTH, EXPERT_WIDTH, EXPERT_WIDTH, EXPERT_WIDTH - 1],
        [EXPERT_WIDTH, half, half, EXPERT_WIDTH, EXPERT_WIDTH, EXPERT_WIDTH],
    ]
    assert_computes_the_same(masked_copy(model, prunings), written_and_loaded_back(pruned, tokenizer, tmp_path))
    modeling_files = {"modeling_casp_mixtral.py", f"modeling_casp_{family}.py"}
    assert modeling_files <= {path.name for path in tmp_path.iterdir()}


@pytest.mark.parametrize("family", FAMILIES)
def test_chosen_experts_are_removed_exactly(family: str, dense_folders: dict[str, Path], tmp_path: Path) -> None:
    """Experts 1 and 4 of layer 0 and 0 and 5 of layer 1 removed (every channel of theirs among the pruned), a few
    channels of a kept one too: the checkpoint keeps 4 experts per layer, the router's kept rows, and computes what
    the masked model (its routers' removed logits at -inf) computes, greedy generation included."""
    model, tokenizer = load_model(str(dense_folders[family]))
    removed = [(1, 4), (0, 5)]
    prunings = [
        LayerPruning(
            (), tuple(c for e in experts for c in range(e * EXPERT_WIDTH, (e + 1) * EXPERT_WIDTH)) + extra, experts
        )
        for experts, extra in zip(removed, [(0, 3), (2 * EXPERT_WIDTH + 7,)], strict=True)
    ]
    pruned = remove_units(model, prunings)
    assert [len(widths) for widths in pruned.config.layer_expert_intermediate_sizes] == [EXPERTS - 2] * 2
    assert pruned.config.layer_expert_intermediate_sizes[0][0] == EXPERT_WIDTH - 2
    for layer, dense_layer, experts in zip(decoder_layers(pruned), decoder_layers(model), removed, strict=True):
        kept = [e for e in range(EXPERTS) if e not in experts]
        assert torch.equal(layer.mlp.gate.weight, dense_layer.mlp.gate.weight[kept])
    assert_computes_the_same(masked_copy(model, prunings), written_and_loaded_back(pruned, tokenizer, tmp_path))


def test_the_per_layer_class_takes_each_layer_s_expert_count() -> None:
    """Layers of 6 and 4 experts in one config: each layer's router and experts are its own count."""
    settings = {k: v for k, v in mixtral_config().to_dict().items() if k != "model_type"}
    sizes = [[EXPERT_WIDTH] * EXPERTS, [EXPERT_WIDTH - 8] * (EXPERTS - REMOVED)]
    model = CaspMixtralForCausalLM(CaspMixtralConfig(**settings, layer_expert_intermediate_sizes=sizes))
    routers = [(layer.mlp.gate.weight.shape[0], layer.mlp.gate.num_experts) for layer in decoder_layers(model)]
    assert routers == [(EXPERTS, EXPERTS), (EXPERTS - REMOVED, EXPERTS - REMOVED)]
    assert [layer.mlp.experts.num_experts for layer in decoder_layers(model)] == [EXPERTS, EXPERTS - REMOVED]
    tokens = torch.randint(0, TINY["vocab_size"], (1, 8))
    assert model(tokens).logits.shape == (1, 8, TINY["vocab_size"])


def test_an_expert_s_statistics_weigh_its_tokens_by_the_router(dense_folder: Path) -> None:
    """C_e over all N tokens, each routed token's activation scaled by its router weight: N x C_e is the sum of
    w² y yᵀ over the tokens routed to e, computed here token by token from the router's own top-k."""
    model, _ = load_model(str(dense_folder))
    layer = decoder_layers(model)[0]
    hidden = torch.randn(10, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    _, weights, experts = layer.mlp.gate(hidden)
    gate_up, down = layer.mlp.experts.gate_up_proj[2], layer.mlp.experts.down_proj[2]
    expected = torch.zeros(EXPERT_WIDTH, EXPERT_WIDTH, dtype=torch.float64)
    for token in range(10):
        for slot in range(TOP_K):
            if experts[token, slot] == 2:
                gate, up = (gate_up @ hidden[token]).chunk(2)
                y = (torch.nn.functional.silu(gate) * up).double() * float(weights[token, slot])
                expected += torch.outer(y, y)
    assert (experts == 2).any()
    batches = [RoutedBatch(hidden[part], experts[part], weights[part], EXPERTS) for part in (slice(4), slice(4, 10))]
    expert = stacked_expert(gate_up, down, layer.mlp.experts.act_fn)
    moment = expert_moment(expert, 2, batches, torch.device("cpu"))
    torch.testing.assert_close(moment.second_moment, expected / 10, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
# 0.5 in make test-slow: the pipeline at 0.5 is checked per family by pipeline_checkpoints' tests below.
@pytest.mark.parametrize("ratio", [0.3, pytest.param(0.5, marks=pytest.mark.slow)])
def test_casp_prune_succeeds(
    family: str, ratio: float, dense_folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(dense_folders[family]), "--ratio", str(ratio), "--out", str(out)]
    assert cli.main([*arguments, *small_run_arguments(tmp_path)]) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["verification"]["max_relative_diff"] <= 1e-10
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == f"casp_{family}"
    widths = config["layer_expert_intermediate_sizes"]
    shared_widths = config.get("layer_shared_expert_intermediate_sizes", [None] * len(widths))
    for layer, layer_widths, shared_width in zip(report["layers"], widths, shared_widths, strict=True):
        routed = [e for e in layer["experts"] if not e["shared"]]
        assert [EXPERT_WIDTH - e["pruned_channels"] for e in routed] == layer_widths
        assert [SHARED_WIDTH - e["pruned_channels"] for e in layer["experts"] if e["shared"]] == (
            [shared_width] if shared_width is not None else []
        )
        assert len(layer["pruned_channels"]) == sum(e["pruned_channels"] for e in layer["experts"])
        assert layer["pruned_heads"] == []


def pruned_at_half(dense_folders: dict[str, Path], root: Path, **settings: Any) -> dict[str, tuple]:
    """Per family, the masked dense model, the pipeline's result at 0.5 (greedy, with `settings`) and its
    checkpoint written under `root`."""
    written = {}
    for family, folder in dense_folders.items():
        model, tokenizer = load_model(str(folder))
        result = prune_small(model, tokenizer, 0.5, "greedy", **settings)  # masks `model`, verifies
        save_pruned(result.model, tokenizer, root / family)
        written[family] = (model, result, root / family)
    return written


@pytest.fixture(scope="module")
def pipeline_checkpoints(dense_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Per family, the masked dense model, the pipeline's result at 0.5 and its written checkpoint."""
    return pruned_at_half(dense_folders, tmp_path_factory.mktemp("moe-pruned"))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_pipeline_meets_the_ratio_from_the_experts_alone(family: str, pipeline_checkpoints: dict) -> None:
    model, result, _ = pipeline_checkpoints[family]
    for dense_layer, layer in zip(decoder_layers(model), decoder_layers(result.model), strict=True):
        assert sublayer_parameters(layer)[0] == sublayer_parameters(dense_layer)[0]  # attention whole
        assert torch.equal(layer.mlp.gate.weight, dense_layer.mlp.gate.weight)  # the router whole
    unit = channel_params(decoder_layers(model)[0])
    assert abs(result.params_dense - result.params_pruned - 0.5 * result.params_dense) <= unit
    assert all(0 <= r <= 0.9 for layer in result.layers for r in [layer.ratio])


@pytest.fixture(scope="module")
def removal_checkpoints(dense_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Per family, as `pipeline_checkpoints` with REMOVED whole experts removed from every layer too."""
    return pruned_at_half(dense_folders, tmp_path_factory.mktemp("moe-experts-removed"), moe={"prune_experts": REMOVED})


@pytest.fixture(scope="module")
def written_checkpoints(pipeline_checkpoints: dict, removal_checkpoints: dict) -> list[tuple[str, object, Path]]:
    """Every family's checkpoint with and without whole experts removed: (family, masked model, folder)."""
    return [
        (family, model, folder)
        for fixture in (pipeline_checkpoints, removal_checkpoints)
        for family, (model, _, folder) in fixture.items()
    ]


@pytest.fixture(scope="module")
def uniform_checkpoints(dense_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """Per family, as `pipeline_checkpoints` in the uniform shape (the family's own class, 3-D expert weights)."""
    return pruned_at_half(dense_folders, tmp_path_factory.mktemp("moe-uniform"), shape="uniform")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("checkpoints", ["removal_checkpoints", "uniform_checkpoints"])
def test_lora_recovery_adapts_every_kept_expert_and_its_adapter_reloads(
    family: str, checkpoints: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two LoRA steps on the pruned model, per layer (whole experts removed, each expert its own width) and
    uniform (3-D expert weights): besides attention's projections and a shared expert's, every kept expert's two
    weights get an adapter (peft's LoRA on parameters, which takes no dropout: a warning says so). The merged
    model keeps the pruned class and shapes, the experts the batches reached have new weights, and the adapter
    peft saved, loaded on the pruned model, computes what the merged weights compute."""
    pruned, tokenizer = load_pruned(request.getfixturevalue(checkpoints)[family][2])
    data = small_training_data(tokenizer, tmp_path)
    config = RecoveryConfig(method="lora", max_steps=2, batch_size=4, grad_accum=1, max_seq_len=32, lr=1e-2)
    run = Run()
    recovered, result = recover(
        copy.deepcopy(pruned), tokenizer, data, config, run, device="cpu", adapter_dir=tmp_path / "adapter"
    )
    assert run.warnings == [
        "recovery: LoRA dropout 0 instead of 0.05: the experts' adapters are on their weights, which peft trains "
        "without dropout, and one dropout covers every adapter"
    ]
    assert type(recovered) is type(pruned)
    assert {n: t.shape for n, t in recovered.state_dict().items()} == {
        n: t.shape for n, t in pruned.state_dict().items()
    }
    # Attention's projections and a shared expert's (nn.Linear); each routed expert's gate_up [2 x width, hidden]
    # and down [hidden, width], a rank x (rows + columns) adapter each.
    projections = [
        module.weight
        for layer in decoder_layers(pruned)
        for name, module in layer.named_modules()
        if name.rsplit(".", 1)[-1] in LORA_TARGETS
    ]
    assert len(projections) == 2 * 4 + (2 * 3 if family == "qwen2_moe" else 0)
    experts, recovered_experts = (
        [e for layer in decoder_layers(m) for e in routed_experts(layer)] for m in (pruned, recovered)
    )
    adapted = sum(sum(weight.shape) for weight in projections) + sum(
        3 * expert.width + 2 * expert.down.shape[0] for expert in experts
    )
    assert result.trainable_parameters == config.rank * adapted
    changed = [
        not torch.equal(before.gate, after.gate) and not torch.equal(before.down, after.down)
        for before, after in zip(experts, recovered_experts, strict=True)
    ]
    assert sum(changed) >= len(changed) // 2, changed
    settings = PruneConfig(ratio=0.5, recovery=config).to_dict()
    report = {"recovery": result.summary(), "settings": settings, "timings": {}, "perplexity": {}, "evaluation": {}}
    modules = ", ".join(LORA_TARGETS if family == "qwen2_moe" else LORA_TARGETS[:4])
    assert recovery_section(report)[2] == (
        f"- LoRA rank 8, alpha 16.0, dropout 0 on {modules} and the parameters gate_up_proj, down_proj; merged into "
        "the weights, the adapter kept in `adapter/`"
    )
    tokens = test_tokens()
    with torch.no_grad():
        merged = recovered(tokens).logits
        adapter = PeftModel.from_pretrained(copy.deepcopy(pruned), tmp_path / "adapter").eval()
        torch.testing.assert_close(adapter(tokens).logits, merged, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(pruned(tokens).logits, merged, atol=1e-3)


def test_the_written_checkpoints_load_where_casp_core_is_not(written_checkpoints: list, tmp_path: Path) -> None:
    """Every family's checkpoint, with and without whole experts removed, in one fresh process, with its own
    modeling file (trust_remote_code=True): the masked model's logits (with removed experts, its routers' removed
    logits at -inf)."""
    logits, records = fresh_logits({folder: True for _, _, folder in written_checkpoints}, tmp_path)
    assert records[-1] == {"casp_core_imported": False}
    classes = {record["checkpoint"]: record["class"] for record in records[:-1]}
    for family, model, folder in written_checkpoints:
        assert classes[str(folder)] == FAMILIES[family][1]
        expected = masked_logits(model)
        assert (logits[str(folder)] - expected).abs().max().item() <= 1e-9 * expected.abs().max().item()


# the lowest transformers: `make test-slow` (tests/core/artifacts/test_generation.py keeps it for LLaMA in `make test`)
@pytest.mark.slow
def test_the_written_checkpoints_load_under_the_lowest_transformers(written_checkpoints: list, tmp_path: Path) -> None:
    """The pruned classes subclass transformers 5.4's MoE classes as well (the lowest the project supports)."""
    logits, records = fresh_logits({folder: True for _, _, folder in written_checkpoints}, tmp_path, lowest=True)
    assert {record["transformers"] for record in records[:-1]} == {lowest_supported_transformers()}
    for _, model, folder in written_checkpoints:
        expected = masked_logits(model)
        assert (logits[str(folder)] - expected).abs().max().item() <= 1e-9 * expected.abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_removed_experts_lose_their_router_rows_and_count_in_the_ratio(family: str, removal_checkpoints: dict) -> None:
    """REMOVED routed experts of every layer, never a shared one: gone from the config, the experts and the router
    (the kept rows the dense router's, in order), and their parameters within the achieved ratio."""
    model, result, _ = removal_checkpoints[family]
    config = result.model.config
    count_key = "num_local_experts" if family == "mixtral" else "num_experts"
    assert getattr(config, count_key) == EXPERTS - REMOVED
    layers = zip(decoder_layers(model), decoder_layers(result.model), result.layers, strict=True)
    for dense_layer, layer, report in layers:
        removed = [expert.index for expert in report.experts if expert.removed]
        assert len(removed) == REMOVED and not any(expert.shared for expert in report.experts if expert.removed)
        # The kept experts' statistics are of the tokens re-routed among them: each token goes to top_k of them.
        routed = sum(expert.tokens for expert in report.experts if not expert.removed and not expert.shared)
        assert routed == 4 * 32 * TOP_K  # prune_small's 4 windows of 32 tokens
        assert all(expert.pruned_channels == EXPERT_WIDTH for expert in report.experts if expert.removed)
        kept = [e for e in range(EXPERTS) if e not in removed]
        assert torch.equal(layer.mlp.gate.weight, dense_layer.mlp.gate.weight[kept])
        assert layer.mlp.experts.num_experts == len(kept) == layer.mlp.gate.num_experts
        for number, expert in enumerate(kept):  # each kept expert's gate and up rows its own dense ones, renumbered
            own = layer.mlp.experts.get_submodule(str(number)).gate_up_proj
            dense_rows = dense_layer.mlp.experts.gate_up_proj[expert]
            assert all(any(torch.equal(row, dense) for dense in dense_rows) for row in own)
    unit = channel_params(decoder_layers(model)[0])
    assert abs(result.params_dense - result.params_pruned - 0.5 * result.params_dense) <= unit


@pytest.mark.parametrize(
    ("family", "ratio", "removed"),
    # One of each family in make test, one and two experts removed among them (Qwen2-MoE's with its shared
    # expert); the rest in make test-slow.
    [
        ("mixtral", 0.3, 1),
        pytest.param("mixtral", 0.5, 2, marks=pytest.mark.slow),
        pytest.param("qwen2_moe", 0.3, 1, marks=pytest.mark.slow),
        ("qwen2_moe", 0.5, 2),
        ("qwen3_moe", 0.3, 1),
        pytest.param("qwen3_moe", 0.5, 2, marks=pytest.mark.slow),
    ],
)
def test_casp_prune_removes_whole_experts(
    family: str,
    ratio: float,
    removed: int,
    dense_folders: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    """`--moe-prune-experts` on the command line: the job verifies, every layer keeps EXPERTS - removed routed
    experts (Qwen2-MoE's shared expert always), and the achieved ratio is the target's."""
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(dense_folders[family]), "--ratio", str(ratio), "--out", str(out)]
    arguments += ["--moe-prune-experts", str(removed), *small_run_arguments(tmp_path)]
    assert cli.main(arguments) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["verification"]["max_relative_diff"] <= 1e-10
    assert abs(report["achieved_ratio"] - ratio) <= report["rounding"]["one_unit"]
    config = json.loads((out / "config.json").read_text())
    assert [len(widths) for widths in config["layer_expert_intermediate_sizes"]] == [EXPERTS - removed] * 2
    for layer in report["layers"]:
        gone = [expert for expert in layer["experts"] if expert["removed"]]
        assert len(gone) == removed and not any(expert["shared"] for expert in gone)
        assert len(layer["pruned_channels"]) == sum(expert["pruned_channels"] for expert in layer["experts"])


def test_removed_experts_count_first_in_the_budget(dense_folder: Path) -> None:
    """Each layer's channel counts start at the removed experts' channels, so a ratio that r_max = 0.5 of every
    expert's channels cannot reach (144 of 288 channels a layer: 0.42 of its parameters) is reached with 2 of 6
    experts removed (96 + 96 channels: 0.56)."""
    model, _ = load_model(str(dense_folder))
    config = PruneConfig(ratio=0.5, r_max=0.5, device="cpu", moe={"prune_experts": REMOVED})
    check_reachable(model, AllocationPlan.of(config))
    plan = plan_budget(model, [0.5, 0.5], AllocationPlan.of(config))
    assert [layer.channel_counts[0] for layer in plan.layers] == [REMOVED * EXPERT_WIDTH] * 2
    with pytest.raises(InvalidConfig, match=r"^ratio: 0.5 cannot be reached .* at most 0.4218"):
        check_reachable(model, AllocationPlan.of(PruneConfig(ratio=0.5, r_max=0.5, device="cpu")))


def test_the_lowest_energy_experts_go_unreached_first_never_the_shared_one() -> None:
    """S_e = E||w_e W_e y_e||^2 orders the routed experts; an unreached one (S_e = 0) goes first; the shared expert
    (numbered after the 4 routed ones) has the lowest S_e here and stays."""
    traffic = [ExpertTraffic(t, 0.1, s) for t, s in ((10, 5.0), (0, 0.0), (10, 0.5), (10, 2.0), (40, 0.1))]
    assert lowest_energy_experts(traffic, 1, routed=4) == [1]
    assert lowest_energy_experts(traffic, 2, routed=4) == [1, 2]
    assert lowest_energy_experts(traffic, 3, routed=4) == [1, 2, 3]


def test_an_unreached_expert_is_the_first_removed(unreached_folder: Path) -> None:
    """The pipeline's criterion on a constructed model: expert 3, which no token reaches, is removed in every layer,
    and with it out of the routing no kept expert is left unreached (no warning)."""
    model, tokenizer = load_model(str(unreached_folder))
    result = prune_small(model, tokenizer, 0.3, "greedy", moe={"prune_experts": 1})
    for layer in result.layers:
        assert [expert.index for expert in layer.experts if expert.removed] == [3]
        assert all(expert.reached for expert in layer.experts if not expert.removed)
    assert all(len(widths) == EXPERTS - 1 for widths in result.model.config.layer_expert_intermediate_sizes)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_masked_router_is_the_dense_one_with_the_removed_logits_at_minus_infinity(
    family: str, dense_folders: dict[str, Path]
) -> None:
    """Softmax over all experts with experts 1 and 4 at -inf, top-2, renormalised (Mixtral) or not (Qwen3-MoE by
    default), written out here: the masked router's picks (in the dense numbering) and weights."""
    model, _ = load_model(str(dense_folders[family]))
    router = decoder_layers(model)[1].mlp.gate
    hidden = torch.randn(40, TINY["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    router.double()
    logits = hidden @ router.weight.T
    logits[:, [1, 4]] = float("-inf")
    probabilities = torch.softmax(logits.float(), dim=-1)
    expected_weights, expected_experts = torch.topk(probabilities, TOP_K, dim=-1)
    if family == "mixtral":
        expected_weights /= expected_weights.sum(dim=-1, keepdim=True)
    route_to_kept_experts(router, [0, 2, 3, 5])
    masked_logits_out, weights, experts = router(hidden)
    assert torch.equal(experts, expected_experts) and not torch.isin(experts, torch.tensor([1, 4])).any()
    torch.testing.assert_close(weights.double(), expected_weights.double(), rtol=1e-6, atol=0)
    assert torch.isinf(masked_logits_out[:, [1, 4]]).all()


@pytest.mark.parametrize(
    ("router_class", "config"),
    [
        (MixtralTopKRouter, MixtralConfig(hidden_size=64, num_local_experts=32, num_experts_per_tok=4)),
        (Qwen3MoeTopKRouter, Qwen3MoeConfig(hidden_size=64, num_experts=32, num_experts_per_tok=4)),
    ],
)
def test_the_masked_router_computes_what_the_router_without_the_rows_computes(
    router_class: type, config: PretrainedConfig
) -> None:
    """Bit for bit, at 32 experts (a softmax with the removed logits at -inf among the others differs in the last
    bit of float32 from 16 experts up), so that verification's 1e-10 holds for Qwen3-30B-A3B's 128 experts too."""
    many = 32
    kept = [e for e in range(many) if e % 4 != 1]
    dense, without = router_class(config), router_class(config)
    generator = torch.Generator().manual_seed(4)
    dense.weight.data = torch.randn(many, 64, dtype=torch.float64, generator=generator)
    without.weight.data = dense.weight.data[kept].clone()
    hidden = torch.randn(64, 64, dtype=torch.float64, generator=generator)
    route_to_kept_experts(dense, kept)
    _, weights, experts = dense(hidden)
    _, expected_weights, expected_experts = without(hidden)
    assert torch.equal(weights, expected_weights) and torch.equal(experts, torch.tensor(kept)[expected_experts])


def test_fewer_experts_than_top_k_left_are_refused(dense_folder: Path, tmp_path: Path, capsys) -> None:
    model_config = load_config(str(dense_folder))
    plan_job(PruneConfig(ratio=0.3, device="cpu", moe={"prune_experts": EXPERTS - TOP_K}), model_config)
    with pytest.raises(
        InvalidConfig, match=r"^moe.prune_experts: removing 5 of the 6 experts .* remove at most 4$"
    ) as message:
        plan_job(PruneConfig(ratio=0.3, device="cpu", moe={"prune_experts": EXPERTS - TOP_K + 1}), model_config)
    arguments = ["prune", "--model", str(dense_folder), "--ratio", "0.3", "--out", str(tmp_path / "out")]
    assert cli.main([*arguments, "--moe-prune-experts", "5", "--device", "cpu"]) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("casp: error")]
    assert errors == [f"casp: error: invalid_config: {message.value.message}"]
    dense = LlamaConfig(**COMMON)
    with pytest.raises(InvalidConfig, match=r"^moe.prune_experts: Llama has no experts to remove"):
        family_of(dense).check_settings(dense, PruneConfig(ratio=0.3, device="cpu", moe={"prune_experts": 1}))


def test_an_unreached_expert_is_reported_and_kept_whole_unless_allowed(unreached_folder: Path) -> None:
    model, tokenizer = load_model(str(unreached_folder))
    result = prune_small(model, tokenizer, 0.5, "greedy")
    pruned_layers = [layer for layer in result.layers if layer.mlp.pruned]
    assert pruned_layers
    for layer in result.layers:
        unreached = [expert for expert in layer.experts if not expert.reached]
        assert [expert.index for expert in unreached] == [3]
        assert unreached[0].tokens == 0 and unreached[0].pruned_channels == 0
    assert all(w[3] == EXPERT_WIDTH for w in result.model.config.layer_expert_intermediate_sizes)

    model, tokenizer = load_model(str(unreached_folder))
    allowed = prune_small(model, tokenizer, 0.5, "greedy", moe={"prune_unreached": True})
    assert any(w[3] < EXPERT_WIDTH for w in allowed.model.config.layer_expert_intermediate_sizes)


def test_the_warning_names_the_unreached_experts(unreached_folder: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(unreached_folder), "--ratio", "0.3", "--out", str(out)]
    assert cli.main([*arguments, *small_run_arguments(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "no calibration token reached experts [3]: kept whole" in err
    report = json.loads((out / "report.json").read_text())
    assert any("reached experts [3]" in warning for warning in report["warnings"])


def test_the_experts_share_follows_their_sensitivity() -> None:
    """The paper's layer rule over the experts: the most sensitive expert keeps every channel (c_e = 0 at alpha 1),
    the others share the layer's count, summing to it."""
    traffic = [ExpertTraffic(10, 0.1, s) for s in (1.0, 4.0, 16.0, 2.0)]
    counts, unreached = expert_counts(
        60, traffic, [EXPERT_WIDTH] * 4, ExpertsPlan.of(PruneConfig(ratio=0.3, device="cpu"))
    )
    assert unreached == [] and sum(counts) == 60
    assert counts[2] == 0 and counts[0] > counts[3] > counts[1]


@pytest.mark.parametrize(
    ("family", "settings", "name"),
    [
        ("mixtral", {"alpha": "auto"}, "alpha"),
        ("mixtral", {"compensation": "bias"}, "compensation"),
        ("mixtral", {"calibration": {"mode": "dense", "n_samples": 4, "seq_len": 32}}, "calibration.mode"),
        ("olmoe", {"quantization": "w8a8_int8"}, "quantization"),
    ],
)
def test_settings_moe_pruning_does_not_take_are_refused(
    family: str, settings: dict, name: str, dense_folders: dict[str, Path]
) -> None:
    with pytest.raises(InvalidConfig, match=rf"^{name}: [\w-]+ \(a mixture of experts\)"):
        plan_job(PruneConfig(ratio=0.3, device="cpu", **settings), load_config(str(dense_folders[family])))


# A user's process: the family's own class from config.json alone (no remote code), its experts run by the eager
# loop, since transformers' default grouped product takes no float64.
_PLAIN_LOGITS = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
tokens, out = torch.load(sys.argv[1]), {}
for path in sys.argv[3:]:
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=False, experts_implementation="eager")
    with torch.no_grad():
        out[path] = model.eval().double()(tokens, use_cache=False).logits
    print(json.dumps({"checkpoint": path, "class": type(model).__name__}))
torch.save(out, sys.argv[2])
print(json.dumps({"casp_core_imported": "casp_core" in sys.modules}))
"""
UNIFORM_FAMILIES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",  # its shared expert kept whole
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# The uniform shape's cases: each family, and two with whole experts removed (the same count in every layer).
# Where config.json keeps the experts' count (Qwen3MoeConfig maps num_experts to num_local_experts).
STORED_EXPERT_COUNT = {
    "mixtral": "num_local_experts",
    "qwen2_moe": "num_experts",
    "qwen3_moe": "num_local_experts",
    "olmoe": "num_experts",
}
UNIFORM_CASES = [(family, 0) for family in UNIFORM_FAMILIES] + [("mixtral", 1), ("qwen3_moe", REMOVED)]


def test_the_uniform_shape_is_the_family_s_own_class(dense_folders: dict[str, Path], tmp_path: Path) -> None:
    """shape uniform at 0.5: the same kept width in every expert of every layer, the same expert count (whole
    experts removed or not), the family's own config and class, no auto_map; in a fresh process that never imports
    casp_core it loads without remote code and computes the masked model's logits."""
    written = {}
    for family, removed in UNIFORM_CASES:
        model, tokenizer = load_model(str(dense_folders[family]))
        moe = {"prune_experts": removed}
        result = prune_small(model, tokenizer, 0.5, "greedy", shape="uniform", moe=moe)  # masks `model`, verifies
        folder = tmp_path / f"{family}-{removed}"
        save_pruned(result.model, tokenizer, folder)
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == family and "auto_map" not in config
        assert config[STORED_EXPERT_COUNT[family]] == EXPERTS - removed
        if family == "qwen2_moe":
            assert config["shared_expert_intermediate_size"] == SHARED_WIDTH
            assert {layer.mlp.shared_expert.down_proj.in_features for layer in decoder_layers(result.model)} == {
                SHARED_WIDTH
            }
        kept = {layer.mlp.experts.down_proj.shape[-1] for layer in decoder_layers(result.model)}
        assert len(kept) == 1 and kept.pop() < EXPERT_WIDTH
        assert {layer.mlp.gate.weight.shape[0] for layer in decoder_layers(result.model)} == {EXPERTS - removed}
        # Within one channel of every kept expert of every layer of the target, the removed experts counted.
        unit = channel_params(decoder_layers(model)[0]) * (EXPERTS - removed) * len(decoder_layers(model))
        assert abs(result.params_dense - result.params_pruned - 0.5 * result.params_dense) <= unit
        written[str(folder)] = masked_logits(model)
    torch.save(test_tokens(), tmp_path / "tokens.pt")
    completed = run_python(_PLAIN_LOGITS, "tokens.pt", "logits.pt", *written, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    records = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    assert records[-1] == {"casp_core_imported": False}
    assert [record["class"] for record in records[:-1]] == [UNIFORM_FAMILIES[family] for family, _ in UNIFORM_CASES]
    logits = torch.load(tmp_path / "logits.pt")
    for folder, expected in written.items():
        difference = (logits[folder] - expected).abs().max().item()
        assert difference <= 1e-9 * expected.abs().max().item()


def test_gguf_export_is_refused_before_any_work() -> None:
    with pytest.raises(UnsupportedExport, match=r"GGUF export: Mixtral .*one width"):
        check_export(mixtral_config(), ["gguf"])


def test_the_memory_model_counts_every_expert_and_one_expert_s_statistics(dense_folder: Path) -> None:
    """casp_core.method.placement: the shape has every expert's weights and the router (the model's own parameter
    count); the statistics are one expert's: at a width of 4096 (C, Q, C_kk and its factor: 4 x 128 MiB in float64)
    a layer of 128 narrow experts needs well under five such matrices, where all experts' C and Q would need 256."""
    model, _ = load_model(str(dense_folder))
    shape = ModelShape.of(model)
    assert (shape.experts, shape.intermediate) == (EXPERTS, EXPERT_WIDTH)
    assert shape.model_parameters() == sum(parameter.numel() for parameter in model.parameters())
    wide = replace(shape, hidden=8, heads=1, kv_heads=1, head_dim=8, intermediate=4096, experts=128)
    job = JobShape(batch_size=1, seq_len=16, gradient_allocation=False, alpha_auto=False, dense_target=False)
    one_matrix = 4096 * 4096 * 8
    assert 4 * one_matrix < estimate_device_memory(wide, job).layer_working_set < 5 * one_matrix


@pytest.mark.parametrize("family", FAMILIES)
def test_the_recovery_memory_model_counts_the_adapters_lora_trains(
    family: str, dense_folders: dict[str, Path], tmp_path: Path
) -> None:
    """casp_core.method.placement's recovery estimate: LoRA's adapters on attention, every expert and a shared expert
    are as many as peft trains (a step of the real recovery on the dense model, whose widths the estimate takes); each
    token's activations go through its top-k experts."""
    model, tokenizer = load_model(str(dense_folders[family]))
    shape = ModelShape.of(model)
    config = RecoveryConfig(method="lora", max_steps=1, batch_size=1, grad_accum=1, max_seq_len=32)
    data = small_training_data(tokenizer, tmp_path)
    _, result = recover(model, tokenizer, data, config, device="cpu")
    estimate = estimate_recovery_memory(shape, config, 0.0, autocast=False)
    assert estimate.optimizer_state == result.trainable_parameters * (FLOAT32 + OPTIMIZER_STATE)
    assert shape.ffn_width_per_token() == TOP_K * EXPERT_WIDTH + (SHARED_WIDTH if family == "qwen2_moe" else 0)
    # Each layer's (and the recomputed one's) gate, activation, up and product per token and expert, with the
    # expert's gathered input and weighted output, in float32, and a tenth more (kept_per_token's margin).
    one_expert = estimate_recovery_memory(replace(shape, experts_per_token=1), config, 0.0, autocast=False)
    per_expert = 4 * EXPERT_WIDTH + 2 * shape.hidden
    extra = (shape.layers + 1) * config.max_seq_len * 1.1 * (TOP_K - 1) * per_expert * FLOAT32
    assert estimate.activations - one_expert.activations == pytest.approx(extra, rel=0.01)
