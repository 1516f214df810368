"""A family that keeps attention whole (`Family.prunes_heads = False`, as OLMo 2's module does): the budget plans
no head anywhere, the ratio (still of attention and MLP together) comes from FFN channels alone, and a ratio they
cannot reach is refused before any work. Shown on a Llama whose family is swapped, for this file only, for a
subclass that keeps heads."""

import pytest
from transformers import LlamaConfig

import casp_core.families
from casp_core.errors import InvalidConfig
from casp_core.families.llama import Llama
from casp_core.method.budget import AllocationPlan, channel_params, check_reachable, plan_uniform_shape
from casp_core.model import decoder_layers, load_model, sublayer_parameters
from casp_core.settings import PruneConfig
from tests.core.families.helpers import COMMON, assert_computes_the_same, prune_small, write_dense


class LlamaKeepingHeads(Llama):
    name = "Llama keeping heads"
    prunes_heads = False


@pytest.fixture
def heads_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(casp_core.families._BY_DENSE_TYPE, "llama", LlamaKeepingHeads())


@pytest.fixture(scope="module")
def dense_folder(tmp_path_factory: pytest.TempPathFactory):
    return write_dense(LlamaConfig(**COMMON), tmp_path_factory.mktemp("dense") / "llama")


def attention_parameters(model) -> list[int]:
    return [sublayer_parameters(layer)[0] for layer in decoder_layers(model)]


@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_only_ffn_channels_go_and_the_ratio_is_met(heads_kept: None, dense_folder, ratio: float) -> None:
    model, tokenizer = load_model(str(dense_folder))
    attention_before = attention_parameters(model)
    result = prune_small(model, tokenizer, ratio, "greedy")  # raises unless its own verification passes
    assert result.model.config.layer_kv_of_query == [[q // 4 for q in range(8)]] * len(attention_before)
    assert attention_parameters(result.model) == attention_before
    widths = [layer.mlp.down_proj.in_features for layer in decoder_layers(result.model)]
    assert sum(widths) < COMMON["intermediate_size"] * len(widths)
    # Counted against attention and MLP together: within one FFN channel's parameters of the target.
    unit = channel_params(decoder_layers(model)[0])
    assert abs(result.params_dense - result.params_pruned - ratio * result.params_dense) <= unit
    assert_computes_the_same(model, [result.model], generation=False)


def test_the_uniform_shape_keeps_every_head(heads_kept: None, dense_folder) -> None:
    model, _ = load_model(str(dense_folder), dtype="float32")
    shape = plan_uniform_shape(model, AllocationPlan.of(PruneConfig(ratio=0.4, shape="uniform")))
    assert (shape.kv_heads, shape.heads_per_kv) == (2, 4)
    assert shape.pruned_channels > 0.4 * COMMON["intermediate_size"]  # more than 0.4: attention gives nothing


def test_a_ratio_the_channels_cannot_reach_is_refused(heads_kept: None, dense_folder) -> None:
    """Attention is 10240 of the layer's 28672 parameters; r_max = 0.8 of the 96 channels remove 76 x 192, 0.509."""
    model, _ = load_model(str(dense_folder))
    assert sublayer_parameters(decoder_layers(model)[0]) == (10240, 18432)
    with pytest.raises(InvalidConfig, match=r"FFN channels alone \(Llama keeping heads keeps attention whole\)"):
        check_reachable(model, AllocationPlan.of(PruneConfig(ratio=0.55, r_max=0.8)))
    check_reachable(model, AllocationPlan.of(PruneConfig(ratio=0.5, r_max=0.8)))
