"""The evaluation card renders every figure of real evaluations, dense beside pruned, with conventions."""

import copy

import lm_eval
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from casp_core.eval.efficiency import compare_efficiency
from casp_core.eval.perplexity import BOS_POLICY
from casp_core.eval.zeroshot import evaluate_zero_shot
from casp_core.report.evaluation_section import render_evaluation_section
from tests.conftest import STORIES
from tests.core.eval.eval_helpers import (
    datasets_dir_or_skip,
    one_torch_thread,  # noqa: F401 (an autouse fixture)
)
from tests.core.eval.eval_models import uneven_copy

TASKS = ["piqa", "boolq"]


@pytest.fixture(scope="module")
def evaluation() -> dict:
    datasets_dir = str(datasets_dir_or_skip())
    dense = AutoModelForCausalLM.from_pretrained(STORIES)
    tokenizer = AutoTokenizer.from_pretrained(STORIES)
    pruned = uneven_copy(dense)
    zero_shot = {
        side: evaluate_zero_shot(model, tokenizer, TASKS, limit=10, datasets_dir=datasets_dir, device="cpu")
        for side, model in (("dense", dense), ("pruned", pruned))
    }
    efficiency = compare_efficiency(
        dense, pruned, device="cpu", batch_size=2, seq_len=16, new_tokens=4, repeats=2, warmup=1
    )
    # The shape casp_core.eval.perplexity gives, measured for both models in a pipeline run.
    perplexity = {
        "wikitext2": {
            "dense": 3.0512,
            "pruned": 58.734,
            "dataset": "wikitext2",
            "split": "test",
            "seq_len": 512,
            "n_windows": 12,
            "n_tokens": 12 * 511,
            "bos": BOS_POLICY,
        }
    }
    return {"perplexity": perplexity, "zero_shot": zero_shot, "efficiency": efficiency}


def test_every_zero_shot_figure_dense_and_pruned(evaluation: dict):
    card = render_evaluation_section(evaluation)
    for side in ("dense", "pruned"):
        out = evaluation["zero_shot"][side]
        for task in TASKS:
            figures = out["tasks"][task]
            assert f"{figures['acc']:.4f} ± {figures['acc_stderr']:.4f}" in card
        piqa = out["tasks"]["piqa"]
        assert f"{piqa['acc_norm']:.4f} ± {piqa['acc_norm_stderr']:.4f}" in card
        assert f"{out['average_acc']:.4f}" in card
    for task in TASKS:
        row = next(line for line in card.splitlines() if line.startswith(f"| {task} |"))
        figures = evaluation["zero_shot"]["dense"]["tasks"][task]
        assert f"| {figures['version']} | {figures['split']} | 10 |" in row
    assert f"lm-evaluation-harness {lm_eval.__version__}, 0-shot, limit 10 documents per task" in card
    assert "dense and pruned evaluated alike" in card


def test_every_efficiency_figure_dense_and_pruned(evaluation: dict):
    card = render_evaluation_section(evaluation)
    for side in ("dense", "pruned"):
        figures = evaluation["efficiency"][side]
        assert f"| {figures['params']:,} |" in card or f" {figures['params']:,} |" in card
        assert f"{figures['latency']['prefill_s']:.4f}" in card
        assert f"{figures['latency']['decode_s']:.4f}" in card
    assert "MACs, prefill of 1 x 128 tokens | 43.68 M |" in card  # 43,679,744 for stories260K
    assert "prefill of 2 x 16 tokens, median of 2 runs after 1 warm-up" in card
    assert "greedy generation of 4 tokens with KV cache" in card
    assert f"cpu (cpu), float32, torch {torch.__version__}" in card
    ratio = evaluation["efficiency"]["pruned"]["params"] / evaluation["efficiency"]["dense"]["params"]
    assert f"{ratio:.3f}" in card


def test_perplexity_with_its_conventions(evaluation: dict):
    card = render_evaluation_section(evaluation)
    assert f"| wikitext2 | test | 512 | 12 | {BOS_POLICY} | 3.051 | 58.734 | {58.734 / 3.0512:.3f} |" in card
    assert "non-overlapping windows of seq_len tokens" in card


def test_different_settings_for_dense_and_pruned_are_flagged(evaluation: dict):
    skewed = copy.deepcopy(evaluation)
    skewed["zero_shot"]["pruned"]["limit"] = None
    skewed["efficiency"]["pruned"]["device"] = "cuda:0"
    card = render_evaluation_section(skewed)
    assert "**different for dense and pruned**" in card and "none (full splits)" in card
    assert "Measured on **different setups**" in card


def test_sections_are_optional():
    assert "No evaluation was run." in render_evaluation_section({})
    card = render_evaluation_section({"perplexity": {"ptb": {"dense": 59.5, "pruned": None, "seq_len": 256}}})
    assert "| ptb | - | 256 | - | not recorded | 59.500 | - | - |" in card
    assert "Zero-shot" not in card and "Efficiency" not in card
