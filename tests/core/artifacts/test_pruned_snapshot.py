"""The pruned snapshot a retry of a job with recovery resumes from: read back whole, and only for the same model
and settings (recovery's aside, which act after it)."""

from pathlib import Path

import torch

from casp_core.artifacts.snapshot import PrunedSnapshot, load_snapshot, save_snapshot, snapshot_fingerprint
from casp_core.eval.evaluate import Figures
from casp_core.model import load_model
from casp_core.settings import PruneConfig
from tests.conftest import STORIES, small_config


def test_a_snapshot_is_read_back_whole_and_only_for_the_same_model_and_settings(tmp_path: Path) -> None:
    model, tokenizer = load_model(str(STORIES))
    config = small_config(0.5)
    fingerprint = snapshot_fingerprint(str(STORIES), None, config)
    pruning = {"achieved_ratio": 0.5, "layers": [{"index": 0}], "timings": {"pruning": {"seconds": 1.5}}}
    snapshot = PrunedSnapshot(
        model, tokenizer, Figures({"wikitext2": 10.5}), Figures({"wikitext2": 12.25}), pruning, "float32", ["slow"]
    )
    save_snapshot(tmp_path, fingerprint, snapshot)

    read = load_snapshot(tmp_path, fingerprint)
    assert read is not None and read.saved_at
    assert read.model.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(read.model.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
    assert read.tokenizer("Once upon a time").input_ids == tokenizer("Once upon a time").input_ids
    assert (read.dense_figures, read.pruned_figures) == (snapshot.dense_figures, snapshot.pruned_figures)
    assert (read.pruning, read.dtype, read.warnings) == (pruning, "float32", ["slow"])
    assert [path.name for path in tmp_path.iterdir()] == ["pruned-snapshot.tar"]  # nothing unpacked stays

    other_recovery = PruneConfig.from_dict({**config.to_dict(), "recovery": {"method": "lora", "max_steps": 7}})
    assert load_snapshot(tmp_path, snapshot_fingerprint(str(STORIES), None, other_recovery)) is not None
    other_ratio = small_config(0.4)
    assert load_snapshot(tmp_path, snapshot_fingerprint(str(STORIES), None, other_ratio)) is None
    assert load_snapshot(tmp_path, snapshot_fingerprint(str(STORIES), "main", config)) is None
