"""`casp prune --recovery lora` and `casp recover` (LoRA and full) end to end on the real model; bad training data
and LoRA flags with `--method full` get one line."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from casp_core.artifacts.checkpoint import load_pruned
from tests.conftest import DATASETS_DIR, STORIES
from tests.core.cli.test_cli import SMALL, casp

# slow (`make test-slow`): `casp prune` with recovery and `casp recover` in fresh processes; recovery itself is in
# tests/core/recovery/test_recovery.py.
pytestmark = pytest.mark.slow

RECOVERY = ["--recovery", "lora", "--max-steps", "3", "--recovery-batch-size", "4", "--grad-accum", "1"]


@pytest.fixture(scope="module")
def ptb_head(tmp_path_factory) -> str:
    """The first lines of PTB train as a user's text file."""
    lines = (DATASETS_DIR / "ptb" / "ptb.train.txt").read_text(encoding="utf-8").splitlines()[:1000]
    path = tmp_path_factory.mktemp("data") / "ptb-head.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def pruned_and_recovered(tmp_path_factory, ptb_head) -> tuple[Path, subprocess.CompletedProcess]:
    """stories260K pruned by 50 % with LoRA recovery: the checkpoint and how `casp prune` went."""
    out = tmp_path_factory.mktemp("prune") / "recovered"
    completed = casp(
        "prune", "--model", str(STORIES), "--ratio", "0.5", "--out", str(out), *SMALL, *RECOVERY,
        "--recovery-dataset", ptb_head, "--recovery-seq-len", "128", "--recovery-lr", "1e-3",
    )  # fmt: skip
    return out, completed


def test_prune_with_recovery_then_recover_the_checkpoint_again(tmp_path, ptb_head, pruned_and_recovered):
    out, completed = pruned_and_recovered
    assert completed.returncode == 0, completed.stderr
    assert "casp: recovery:" in completed.stderr
    summary = json.loads(completed.stdout)
    ptb = summary["perplexity"]["ptb"]
    assert ptb["recovered"] < ptb["pruned"], ptb
    report = json.loads((out / "report.json").read_text())
    assert [point["step"] for point in report["recovery"]["curve"]] == [1, 2, 3]
    assert report["recovery"]["tokens"] == 3 * 4 * 128 and report["recovery"]["data"]["layout"] == "text"
    assert report["settings"]["recovery"]["max_steps"] == 3
    assert "plots/recovery_loss.png" in report["plots"] and (out / "plots" / "recovery_loss.png").is_file()
    markdown = (out / "report.md").read_text()
    assert "## Recovery" in markdown and "| ptb | " in markdown.split("## Recovery")[1]
    model, _ = load_pruned(out)
    assert (out / "adapter" / "adapter_config.json").is_file()

    again = tmp_path / "again"
    completed = casp(
        "recover", str(out), "--dataset", ptb_head, "--max-steps", "2", "--batch-size", "2", "--grad-accum", "1",
        "--max-seq-len", "64", "--datasets-dir", str(DATASETS_DIR), "--out", str(again),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["steps"] == 2
    recovery = json.loads((again / "recovery.json").read_text())
    assert recovery["checkpoint"] == str(out) and len(recovery["curve"]) == 2
    assert (again / "plots" / "recovery_loss.png").is_file()
    recovered_again, _ = load_pruned(again)
    assert recovered_again.config.casp["recovery"]["max_seq_len"] == 64
    # The adapter applies to the checkpoint it was trained on.
    adapted = PeftModel.from_pretrained(model, again / "adapter")
    assert adapted.peft_config["default"].r == 8


def test_bad_training_data_fails_before_pruning_with_one_line(tmp_path):
    bad = tmp_path / "alpaca.jsonl"
    bad.write_text('{"instruction": "Say hi.", "output": "Hi."}\n{"instruction": "No output."}\n', encoding="utf-8")
    completed = casp(
        "prune", "--model", str(STORIES), "--ratio", "0.5", "--out", str(tmp_path / "out"), *SMALL, *RECOVERY,
        "--recovery-dataset", str(bad),
    )  # fmt: skip
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1] == f"casp: error: invalid_dataset: {bad} line 2: missing `output`"
    assert "casp: pruning:" not in completed.stderr
    assert not (tmp_path / "out").exists()


def test_recover_full_trains_the_decoder_layers_only(tmp_path, ptb_head, pruned_and_recovered):
    checkpoint, pruning = pruned_and_recovered
    assert pruning.returncode == 0, pruning.stderr
    out = tmp_path / "full"
    completed = casp(
        "recover", str(checkpoint), "--method", "full", "--dataset", ptb_head, "--max-steps", "2", "--batch-size",
        "2", "--grad-accum", "1", "--max-seq-len", "64", "--lr", "1e-3", "--datasets-dir", str(DATASETS_DIR),
        "--out", str(out),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["steps"] == 2
    before, _ = load_pruned(checkpoint)
    after, _ = load_pruned(out)
    assert after.config.casp["recovery"]["method"] == "full"
    old, new = before.state_dict(), after.state_dict()
    assert old.keys() == new.keys()
    layers = [name for name in old if name.startswith("model.layers.")]
    # Every kept weight of every decoder layer moved (AdamW's first step moves each by about lr); nothing else did.
    assert layers and [name for name in layers if torch.equal(old[name], new[name])] == []
    assert [name for name in old if name not in layers and not torch.equal(old[name], new[name])] == []
    recovery = json.loads((out / "recovery.json").read_text())
    assert recovery["trainable_parameters"] == sum(old[name].numel() for name in layers)
    assert recovery["adapter"] is None and not (out / "adapter").exists()


def test_lora_flags_with_method_full_get_one_line(tmp_path, ptb_head, pruned_and_recovered):
    checkpoint, _ = pruned_and_recovered
    out = tmp_path / "out"
    completed = casp(
        "recover", str(checkpoint), "--method", "full", "--target-modules", "q_proj", "--dataset", ptb_head,
        "--out", str(out),
    )  # fmt: skip
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1] == (
        "casp: error: invalid_config: --target-modules: a LoRA setting, unused by --method full"
    )
    assert not out.exists()
    shown = casp("recover", "--help")
    assert shown.returncode == 0 and "--method {lora,full}" in shown.stdout
    assert "a checkpoint does not carry the dense model" in " ".join(shown.stdout.split())
