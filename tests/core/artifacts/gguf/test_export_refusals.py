"""A GGUF export the model's family or settings cannot take is refused before any work with `unsupported_export`:
by `casp prune`, by a job that reaches the worker, and by `casp export` of a checkpoint. A tokenizer llama.cpp
cannot reproduce is refused by the job (and a budget's sweep over GGUF types) with `unsupported_model` once the
dense model is loaded, not at the export after the prune."""

import json
import re
from pathlib import Path

import pytest
import tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

from casp_core.cli import main as cli
from casp_core.errors import DatasetNotFound, UnsupportedExport, UnsupportedModel
from casp_core.families import check_export
from casp_core.job.run import run_job
from casp_core.model import load_config
from casp_core.settings import PruneConfig
from tests.core.families.helpers import COMMON, small_run_arguments, write_dense

QWEN3 = {**COMMON, "num_attention_heads": 6, "head_dim": 16}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
LLAMA3_ROPE |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")
    return {
        "qwen3": write_dense(Qwen3Config(**QWEN3), root / "qwen3"),
        "llama": write_dense(LlamaConfig(**COMMON), root / "llama"),
        # Without weights: the command line refuses from the config, before it loads any.
        "qwen3 config": write_dense(Qwen3Config(**QWEN3), root / "qwen3-config", weights=False),
        "llama byte-level": with_byte_level_tokenizer(write_dense(LlamaConfig(**COMMON), root / "llama-bbpe")),
    }


def with_byte_level_tokenizer(folder: Path) -> Path:
    """`folder` with a GPT-2 style (byte-level BPE) tokenizer in place of its SentencePiece-style one."""
    byte_level = tokenizers.Tokenizer(tokenizers.models.BPE())
    byte_level.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    byte_level.train_from_iterator(["the cat sat on the mat", "a dog ran in the park"] * 20, trainer)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=byte_level, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (Qwen3Config(**QWEN3), "GGUF export: Qwen3 (model type 'qwen3'): its per-head q/k norms"),
        (LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE), "RoPE type 'llama3'"),
        (LlamaConfig(**COMMON, hidden_act="gelu"), "activation 'gelu'"),
    ],
)
def test_what_the_gguf_writer_cannot_write_is_refused_from_the_config(config: LlamaConfig, named: str) -> None:
    with pytest.raises(UnsupportedExport, match=re.escape(named)):
        check_export(config, ["gguf"])
    check_export(config, [])  # no export asked: nothing to refuse


def test_casp_prune_refuses_in_one_line_before_any_work(
    dense: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    arguments = ["prune", "--model", str(dense["qwen3 config"]), "--ratio", "0.3", "--out", str(out)]
    capfd.readouterr()
    status = cli.main([*arguments, "--export", "gguf", *small_run_arguments(tmp_path)])
    errors = capfd.readouterr().err.strip().splitlines()
    assert status == 2 and len(errors) == 1, errors
    assert errors[0].startswith("casp: error: unsupported_export: GGUF export: Qwen3 (model type 'qwen3')"), errors
    assert not out.exists()


def test_a_job_fails_with_the_code_before_any_work(dense: dict[str, Path], tmp_path: Path) -> None:
    """The worker's path (the API reads a hub model's config only when the job starts): refused once the dense
    model is loaded, before calibration data is read (the data set named here does not exist)."""
    calibration = {"dataset": str(tmp_path / "no-such-set.txt")}
    config = PruneConfig.from_dict({"ratio": 0.3, "export": ["gguf"], "calibration": calibration, "device": "cpu"})
    with pytest.raises(UnsupportedExport, match="Qwen3"):
        run_job(str(dense["qwen3"]), config.validate(), tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_casp_export_of_a_qwen3_checkpoint_is_refused(
    dense: dict[str, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.gguf"
    capfd.readouterr()
    status = cli.main(["export", str(dense["qwen3"]), "--format", "gguf", "--out", str(out)])
    errors = capfd.readouterr().err.strip().splitlines()
    assert status == 2 and errors == [errors[0]] and "unsupported_export: GGUF export: Qwen3" in errors[0], errors
    assert not out.exists()
    assert json.loads((dense["llama"] / "config.json").read_text())["model_type"] == "llama"
    check_export(load_config(str(dense["llama"])), ["gguf"])  # a Llama without rope scaling has its GGUF path


@pytest.mark.parametrize("settings", [{"ratio": 0.3, "export": ["gguf"]}, {"target": {"max_bytes": 10**6}}])
def test_a_tokenizer_llama_cpp_cannot_reproduce_fails_the_job_before_any_work(
    dense: dict[str, Path], tmp_path: Path, settings: dict
) -> None:
    """A single-ratio job exporting GGUF, and a budget (GGUF candidates by default): refused once the dense model is
    loaded, before the calibration data is read (the data set named does not exist)."""
    calibration = {"dataset": str(tmp_path / "no-such-set.txt")}
    config = PruneConfig.from_dict({**settings, "calibration": calibration, "device": "cpu"})
    with pytest.raises(UnsupportedModel, match=re.escape("cannot reproduce this tokenizer: pre-tokenizer ByteLevel")):
        run_job(str(dense["llama byte-level"]), config.validate(), tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    # Without a GGUF file to write, the same model goes on, to the calibration data.
    plain = PruneConfig.from_dict({"ratio": 0.3, "calibration": calibration, "device": "cpu"})
    with pytest.raises(DatasetNotFound, match="no-such-set"):
        run_job(str(dense["llama byte-level"]), plain.validate(), tmp_path / "plain")
