"""Real models with per-layer shapes, as pruned models have, for the evaluation tests."""

import atexit
import copy
import functools
import shutil
import tempfile
from pathlib import Path

from torch import nn
from transformers import LlamaForCausalLM

from casp_core.job.run import run_job
from casp_core.settings import CalibrationConfig, EvaluationConfig, PruneConfig
from tests.conftest import STORIES


def _keep_first(linear: nn.Linear, *, rows: int | None = None, cols: int | None = None) -> nn.Linear:
    weight = linear.weight.data[:rows, :cols]
    smaller = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    smaller.weight.data.copy_(weight)
    return smaller


def uneven_copy(dense: LlamaForCausalLM) -> LlamaForCausalLM:
    """A copy with layer-dependent shapes, as a pruned model has: layer l keeps max(1, 4 - l) of
    stories260K's key/value heads with their query heads, and 172 - 30 l FFN channels (the first units:
    only the shapes matter here). transformers' Llama layers infer head counts from the shapes, so the
    copy runs."""
    model = copy.deepcopy(dense)
    head_dim = model.config.head_dim
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for index, layer in enumerate(model.model.layers):
        kv_heads = max(1, model.config.num_key_value_heads - index)
        q_rows, kv_rows = kv_heads * group * head_dim, kv_heads * head_dim
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = _keep_first(attn.q_proj, rows=q_rows)
        attn.k_proj = _keep_first(attn.k_proj, rows=kv_rows)
        attn.v_proj = _keep_first(attn.v_proj, rows=kv_rows)
        attn.o_proj = _keep_first(attn.o_proj, cols=q_rows)
        channels = model.config.intermediate_size - 30 * index
        mlp.gate_proj = _keep_first(mlp.gate_proj, rows=channels)
        mlp.up_proj = _keep_first(mlp.up_proj, rows=channels)
        mlp.down_proj = _keep_first(mlp.down_proj, cols=channels)
    return model


@functools.cache
def pruned_checkpoint(datasets_dir: Path) -> tuple[Path, dict]:
    """stories260K pruned at 30 % by the project's own pipeline (small calibration), as a checkpoint
    directory, and its report; built once per test session."""
    root = Path(tempfile.mkdtemp(prefix="casp-eval-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    config = PruneConfig(
        ratio=0.3,
        # The offline copies have no WikiText-2 train split (fixtures/PROVENANCE.md).
        calibration=CalibrationConfig(dataset="wikitext2:validation", n_samples=8, seq_len=128, batch_size=8),
        evaluation=EvaluationConfig(perplexity=[]),
        datasets_dir=str(datasets_dir),
        device="cpu",
    )
    report = run_job(str(STORIES), config, root / "pruned")
    return root / "pruned", report
