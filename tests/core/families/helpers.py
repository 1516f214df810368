"""What every family's tests share: tiny random checkpoints of transformers' own classes, masking, pruning through
the real pipeline, and the exactness check (pruned == masked, after writing and loading back).

A family's test file (tests/core/families/test_<family>.py) imports these; tests/core/families/test_families.py uses
them for Llama, Mistral, Qwen2 and Qwen3.
"""

import copy
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.method.prune import prune
from casp_core.method.results import PruneResult
from casp_core.method.surgery import LayerPruning, mask_layer
from casp_core.model import attention_geometry, decoder_layers
from casp_core.recovery.data import TrainingData, load_training_data
from casp_core.settings import CalibrationConfig, PruneConfig
from tests.conftest import DATASETS_DIR, STORIES

VOCAB, WIDTH, LAYERS = 512, 96, 3  # the stories260K tokenizer has 512 tokens
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": WIDTH,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
WINDOW = 8  # shorter than the test inputs, so a lost sliding window changes the logits
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def write_dense(config: PretrainedConfig, folder: Path, *, weights: bool = True, tokenizer: bool = True) -> Path:
    """A random checkpoint: every weight, bias and norm drawn at random, so none of them may be lost unseen."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            else:
                parameter.normal_(0, 0.15)
    model.save_pretrained(folder)
    if not weights:
        (folder / "model.safetensors").unlink()
    if tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copy(STORIES / name, folder)
    return folder


def masked_copy(model: PreTrainedModel, prunings: list[LayerPruning]) -> PreTrainedModel:
    masked = copy.deepcopy(model)
    for layer, pruning in zip(decoder_layers(masked), prunings, strict=True):
        mask_layer(layer, attention_geometry(masked, layer), pruning)
    return masked


def written_and_loaded_back(pruned: PreTrainedModel, tokenizer, folder: Path) -> list[PreTrainedModel]:
    save_pruned(pruned, tokenizer, folder)
    return [load_pruned(folder)[0], AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()]


@torch.no_grad()
def assert_computes_the_same(
    masked: PreTrainedModel, pruned_models: list[PreTrainedModel], *, generation: bool = True
) -> None:
    """Logits in float64 (where removing units and masking them agree to rounding) and, with `generation`,
    greedy generation through the KV cache past the sliding window."""
    masked = copy.deepcopy(masked).double()
    tokens = torch.randint(0, VOCAB, (2, 4 * WINDOW), generator=torch.Generator().manual_seed(3))
    expected = masked(tokens, use_cache=False).logits
    prompt = tokens[:1, :6]
    if generation:
        generated = masked.generate(prompt, max_new_tokens=WINDOW + 4, do_sample=False, use_cache=True)
    for pruned in pruned_models:
        pruned = copy.deepcopy(pruned).double()
        difference = (expected - pruned(tokens, use_cache=False).logits).abs().max().item()
        assert difference <= 1e-9 * max(1.0, expected.abs().max().item())
        if generation:
            assert torch.equal(
                pruned.generate(prompt, max_new_tokens=WINDOW + 4, do_sample=False, use_cache=True), generated
            )


def chosen_prunings(num_heads: int) -> list[LayerPruning]:
    """Uneven groups (two key/value heads left serving different numbers of query heads), a layer that loses
    every head and half its channels, and a layer that loses one whole group."""
    return [
        LayerPruning((0, 1, 4), (0, 3, 7)),
        LayerPruning(tuple(range(num_heads)), tuple(range(0, WIDTH, 2))),
        LayerPruning(tuple(range(num_heads // 2)), ()),
    ]


def prune_small(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, ratio: float, solver: str, **settings: Any
) -> PruneResult:
    """The real pipeline (gradient allocation, sequential calibration, its own verification) on a few random
    windows; it masks `model` in place."""
    calibration = CalibrationConfig(n_samples=4, seq_len=32, batch_size=4)
    config = PruneConfig(ratio=ratio, solver=solver, calibration=calibration, device="cpu", **settings)
    windows = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(5))
    return prune(model, tokenizer, config, windows=windows)


def layer_outputs_of_the_model_s_own_forward(model: PreTrainedModel, windows: torch.Tensor) -> list[torch.Tensor]:
    outputs: list[torch.Tensor] = []
    handles = [
        layer.register_forward_hook(lambda _m, _a, out: outputs.append(out[0] if isinstance(out, tuple) else out))
        for layer in decoder_layers(model)
    ]
    try:
        with torch.no_grad():
            model(windows, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def small_text(folder: Path) -> Path:
    """A few kilobytes of WikiText-2 written into `folder`, since tokenizing a whole split takes seconds."""
    text = folder / "wiki.txt"
    with (DATASETS_DIR / "wikitext-2-raw" / "wiki.test.raw").open(encoding="utf-8") as source:
        text.write_text(source.read(6000), encoding="utf-8")
    return text


def small_training_data(tokenizer: PreTrainedTokenizerBase, folder: Path) -> TrainingData:
    """`small_text` as recovery's training data: sequences of at most 32 tokens."""
    return load_training_data(str(small_text(folder)), tokenizer, max_seq_len=32, context=256)


def small_run_arguments(folder: Path) -> list[str]:
    """`casp prune` arguments for a quick whole job on the CPU: `small_text` for calibration and evaluation."""
    text = small_text(folder)
    return [
        *("--calibration-dataset", str(text), "--n-samples", "4", "--seq-len", "32"),
        *("--perplexity", str(text), "--eval-seq-len", "32", "--eval-limit", "2", "--device", "cpu"),
    ]
