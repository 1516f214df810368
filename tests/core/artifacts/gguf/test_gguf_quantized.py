"""Quantized GGUFs by llama.cpp's own quantizer, from checkpoints pruned for them (issue 22, items 1, 2 and 6; issue
37, item 2).

Each fixture model is pruned once, by `casp prune` as a user runs it: ptbwiki-7M (hidden 256, head_dim 32, FFN
704) for q4_k_m, whose block of 256 `round_to: auto` then fits the FFN widths to, and stories260K (hidden 64,
head_dim 8, FFN 172) for q8_0 and its block of 32. Every type is then written from those two checkpoints, read
back, loaded in llama.cpp (one thread) and asked for a few tokens. A random model of SmolLM2's proportions, whose
hidden size is no multiple of 256, gets the K-quants with llama.cpp's fallbacks, as llama.cpp's own quantizer
gives them to a file of the same shapes.
"""

import contextlib
import ctypes
import io
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
from transformers import LlamaConfig

from casp_core.artifacts.gguf.types import LLAMA_CPP_MISSING
from casp_core.artifacts.gguf.writer import export_gguf
from casp_core.cli.main import main
from casp_core.rounding import BLOCK_32_TYPES, K_QUANTS, fallback_warning
from tests.conftest import DATASETS_DIR, PTBWIKI, REPO, STORIES
from tests.core.families.helpers import small_run_arguments, write_dense

SMALL = ["--datasets-dir", str(DATASETS_DIR), "--calibration-dataset", "wikitext2:validation"]
SMALL += ["--n-samples", "8", "--seq-len", "64", "--perplexity", ""]
PROMPT = "The company said"
NEW_TOKENS = 8
# SmolLM2-135M (hidden 576 = 9 heads of 64 over 3 key/value heads, FFN 1536 = 6 x 256, tied head) scaled down:
# hidden 192 = 6 heads of 32 over 2, no multiple of 256 either; FFN 512, two super-blocks; 16 layers, so that
# q3_k_m's first 1/16 of ffn_down gets more bits.
SMOLLM2_LIKE = {
    "vocab_size": 512,  # the stories260K tokenizer's
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 16,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's rule for the layers whose ffn_down (and attn_v) get more bits in the _M mixes."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@pytest.fixture(scope="module")
def pruned(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """(checkpoint directory, the command's summary line) of each fixture model, pruned once for the module by
    the command (its summary line read from stdout as a user reads it)."""
    root = tmp_path_factory.mktemp("pruned")
    built = {}
    for name, model, gguf_type in (("ptbwiki-7M", PTBWIKI, "q4_k_m"), ("stories260K", STORIES, "q8_0")):
        out = root / name
        arguments = ["prune", "--model", str(model), "--ratio", "0.3", "--out", str(out), *SMALL]
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            assert main([*arguments, "--export", "gguf", "--gguf-type", gguf_type]) == 0
        built[name] = (out, json.loads(stdout.getvalue().splitlines()[-1]))
    return built


def generate(path: Path) -> list[int]:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, verbose=False)
    prompt = llm.tokenize(PROMPT.encode())
    tokens = []
    for token in llm.generate(prompt, temp=0.0, top_k=1):
        tokens.append(token)
        if len(tokens) == NEW_TOKENS:
            break
    llm.close()
    return tokens


def llama_cpp_size(path: Path) -> tuple[int, int]:
    """llama.cpp's model size (bytes) and parameter count of the file, whose ratio is the BPW it reports."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=16, n_threads=1, verbose=False)
    try:
        return llama_cpp.llama_model_size(llm.model), llama_cpp.llama_model_n_params(llm.model)
    finally:
        llm.close()


def read_types(path: Path) -> tuple[dict[str, str], dict[str, int], float]:
    """Each tensor's type and row length, and the bits per weight, as the file has them."""
    tensors = gguf.GGUFReader(path).tensors
    bits = sum(int(t.n_bytes) for t in tensors) * 8 / sum(int(t.n_elements) for t in tensors)
    return {t.name: t.tensor_type.name for t in tensors}, {t.name: int(t.shape[0]) for t in tensors}, bits


def test_q4_k_m_of_ptbwiki_gets_llama_cpps_mix_with_whole_blocks_in_every_ffn(pruned):
    out, summary = pruned["ptbwiki-7M"]
    report = json.loads((out / "report.json").read_text())
    (export,) = report["exports"]
    path = out / export["path"]
    types, _, bits = read_types(path)
    reader = gguf.GGUFReader(path)
    widths = reader.get_field("deci.feed_forward_length").contents()
    heads = reader.get_field("deci.attention.head_count").contents()

    # Item 2: every layer keeps whole blocks of 256 FFN channels (704 is not one: even a spared layer prunes).
    assert all(width % 256 == 0 for width in widths) and len(widths) == 8
    rounding = report["rounding"]
    assert rounding["block"] == 256 and rounding["ffn_multiples"] == [256] * 8 and rounding["head_multiple"] == 8
    assert abs(report["achieved_ratio"] - 0.3) <= rounding["one_unit"]
    assert rounding["one_unit"] == pytest.approx(256 * 3 * 256 / report["params"]["dense"])
    assert summary["rounding"]["achieved_minus_target"] == round(report["achieved_ratio"] - 0.3, 4)

    # Item 1: llama.cpp's q4_k_m mix on every FFN tensor, none falling back.
    for layer in range(8):
        assert types[f"blk.{layer}.ffn_gate.weight"] == types[f"blk.{layer}.ffn_up.weight"] == "Q4_K"
        assert types[f"blk.{layer}.ffn_down.weight"] == ("Q6_K" if use_more_bits(layer, 8) else "Q4_K")
    assert types["token_embd.weight"] == "Q6_K"  # tied: the output's type
    # o_proj rows are heads x 32: only 0 or 8 heads fill blocks of 256, so the pruned layers' o_proj falls back
    # (two heads or more away), Q4_K -> Q5_0, each named.
    expected = [
        {
            "tensor": f"blk.{layer}.attn_output.weight",
            "type": "Q5_0",
            "wanted": "Q4_K",
            "row_length": count * 32,
            "block": 256,
        }
        for layer, count in enumerate(heads)
        if count % 8
    ]
    assert expected and export["fallbacks"] == expected
    assert all(types[fallback["tensor"]] == "Q5_0" for fallback in expected)
    assert export["tensor_types"] == Counter(types.values())
    assert export["bits_per_weight"] == pytest.approx(bits) and 4.5 < bits < 6.5
    size, params = llama_cpp_size(path)
    assert export["bits_per_weight"] == pytest.approx(size * 8 / params)
    assert export["bytes"] == path.stat().st_size
    # The f32 file llama.cpp quantized is gone: the folder holds the checkpoint and the one GGUF.
    assert sorted(p.name for p in out.iterdir() if "gguf" in p.name) == ["model-q4_k_m.gguf"]
    assert not list(out.glob(".*partial"))

    markdown = (out / "report.md").read_text()
    card = (out / "README.md").read_text()
    for text in (markdown, card):
        assert "## GGUF files" in text and f"| model-q4_k_m.gguf | q4_k_m | {path.stat().st_size:,} |" in text
        assert (
            f"whose rows of {expected[0]['row_length']} weights are not whole blocks of 256: `attn_output` in" in text
        )
        assert "- rounding: FFN widths in multiples of 256 and 8-head multiples" in text

    assert len(generate(path)) == NEW_TOKENS


def test_q8_0_of_stories260k_rounds_ffn_to_32_and_names_the_o_proj_it_could_not_fit(pruned):
    out, _ = pruned["stories260K"]
    report = json.loads((out / "report.json").read_text())
    (export,) = report["exports"]
    path = out / export["path"]
    types, rows, bits = read_types(path)
    assert report["rounding"]["ffn_multiples"] == [32] * 5 and report["rounding"]["head_multiple"] == 4
    for layer in range(5):
        assert rows[f"blk.{layer}.ffn_down.weight"] % 32 == 0
        assert types[f"blk.{layer}.ffn_down.weight"] == "Q8_0"
    # o_proj rows are heads x 8: a multiple of 32 with 4 or 8 heads. Every other count is F16, named.
    expected = sorted(name for name, row in rows.items() if name.endswith("attn_output.weight") and row % 32)
    assert [fallback["tensor"] for fallback in export["fallbacks"]] == expected
    assert all(f["type"] == "F16" and (f["wanted"], f["block"]) == ("Q8_0", 32) for f in export["fallbacks"])
    assert {types[name] for name in types if name not in expected and not name.endswith("norm.weight")} == {"Q8_0"}
    assert export["bits_per_weight"] == pytest.approx(bits)
    assert len(generate(path)) == NEW_TOKENS


@pytest.mark.parametrize(
    ("name", "gguf_type"),
    [("ptbwiki-7M", t) for t in (*K_QUANTS, *BLOCK_32_TYPES)] + [("stories260K", t) for t in BLOCK_32_TYPES],
)
def test_every_quantized_type_is_written_by_llama_cpp_and_loads_and_generates(pruned, tmp_path, name, gguf_type):
    out, _ = pruned[name]
    exported = export_gguf(out, tmp_path / "model.gguf", gguf_type)
    types, rows, bits = read_types(exported.path)
    assert exported.tensor_types == types
    assert exported.bits_per_weight == pytest.approx(bits)
    file_type = gguf.GGUFReader(exported.path).get_field("general.file_type").contents()
    assert file_type == getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}")
    # Every fallback is a weight whose rows are not whole blocks of 256, and every such weight not of the
    # file's own block-32 type is named.
    for fallback in exported.fallbacks:
        assert rows[fallback.tensor] % fallback.block and types[fallback.tensor] == fallback.type
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
    tokens = generate(exported.path)
    assert len(tokens) == NEW_TOKENS


# slow (`make test-slow`): toy models' agreement; the real model's q4_k_m is measured in tests/worker/test_real_model.py
@pytest.mark.slow
def test_the_quantized_files_follow_the_f32_file(pruned, tmp_path):
    """llama.cpp's logits over a text: the quantized file's greedy choices agree with the f32 file's mostly,
    and fewer bits agree less (q8_0 > q4_0)."""
    out, _ = pruned["ptbwiki-7M"]
    text = (DATASETS_DIR / "ptb" / "ptb.valid.txt").read_text()[:1500]
    agreement = {}
    reference = None
    for gguf_type in ("f32", "q8_0", "q4_0"):
        exported = export_gguf(out, tmp_path / f"{gguf_type}.gguf", gguf_type)
        llm = llama_cpp.Llama(
            model_path=str(exported.path), n_ctx=256, n_batch=256, logits_all=True, n_threads=1, verbose=False
        )
        ids = llm.tokenize(text.encode())[:256]
        llm.eval(ids)
        choices = np.asarray(llm.scores[: len(ids)]).argmax(-1)
        llm.close()
        reference = choices if reference is None else reference
        agreement[gguf_type] = float((choices == reference).mean())
    # Measured: 100 % and 94.9 %.
    assert agreement["q8_0"] >= 0.98, agreement
    assert 0.85 <= agreement["q4_0"] < agreement["q8_0"], agreement


def same_shape_f32(source: Path, out: Path) -> Path:
    """An F32 GGUF of `source`'s architecture, hyperparameters and tensor shapes, with random weights and no
    tokenizer, written here without casp's writer: all llama.cpp's quantizer chooses a tensor's type from."""
    reader = gguf.GGUFReader(source)
    architecture = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(out, architecture)
    for field in reader.fields.values():
        if field.name.startswith(f"{architecture}."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if array else None)
    generator = np.random.default_rng(0)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, generator.standard_normal(tuple(reversed(tensor.shape.tolist())), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama_cpp_quantized(source: Path, out: Path, gguf_type: str) -> Path:
    """`llama-quantize source out gguf_type`, through llama-cpp-python's binding."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}")
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


@pytest.fixture(scope="module")
def smollm2_like(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(dense checkpoint, pruned checkpoint, the command's summary line): a random model of SmolLM2's proportions,
    pruned once for the module by `casp prune --export gguf --gguf-type q4_k_m` as a user runs it."""
    root = tmp_path_factory.mktemp("smollm2-like")
    dense = write_dense(LlamaConfig(**SMOLLM2_LIKE), root / "dense")
    out = root / "pruned"
    arguments = ["prune", "--model", str(dense), "--ratio", "0.3", "--out", str(out), *small_run_arguments(root)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main([*arguments, "--export", "gguf", "--gguf-type", "q4_k_m"]) == 0
    return dense, out, json.loads(stdout.getvalue().splitlines()[-1])


def test_q4_k_m_of_a_hidden_size_no_multiple_of_256_names_each_fallback(smollm2_like):
    """SmolLM2's case: `casp prune --export gguf --gguf-type q4_k_m` works; round_to auto fits the FFN widths to the
    block, and the tensors whose rows are no whole blocks fall back, each named in the export and the report."""
    _, out, summary = smollm2_like
    (export,) = summary["exports"]
    path = out / export["path"]
    types, rows, _ = read_types(path)
    widths = gguf.GGUFReader(path).get_field("deci.feed_forward_length").contents()
    assert any(width < 512 for width in widths)  # pruned: the comparison below is on pruned shapes

    # round_to auto still fits every FFN width to the block: ffn_down keeps its K-quant; the rows of hidden 192
    # (q/k/v, gate/up, the tied embedding) and of 6 heads or fewer of 32 (o_proj) fall back.
    assert all(width % 256 == 0 for width in widths)
    assert {types[f"blk.{layer}.ffn_down.weight"] for layer in range(16)} == {"Q4_K", "Q6_K"}
    fallen = {f["tensor"]: (f["type"], f["wanted"], f["row_length"], f["block"]) for f in export["fallbacks"]}
    assert fallen["token_embd.weight"] == ("Q8_0", "Q6_K", 192, 256)
    assert fallen["blk.0.ffn_up.weight"] == ("Q5_0", "Q4_K", 192, 256)
    assert fallen["blk.0.attn_v.weight"] == ("Q8_0", "Q6_K", 192, 256)  # use_more_bits' layer
    matrices = {name for name, row in rows.items() if not name.endswith("norm.weight") and row % 256}
    assert set(fallen) == matrices
    markdown = (out / "report.md").read_text()
    assert "- Q5_0 instead of Q4_K: " in markdown
    assert "whose rows of 192 weights are not whole blocks of 256: " in markdown
    assert "`ffn_gate`, `ffn_up` in layers 0-15" in markdown
    # The tied embedding and the attn_v that get more bits (Q6_K) take Q6_K's fallback, grouped on one line.
    more_bits = [name for name, kind in types.items() if kind == "Q8_0"]
    assert "token_embd.weight" in more_bits and len(more_bits) > 1
    assert (
        f"- Q8_0 instead of Q6_K: {len(more_bits)} tensors whose rows of 192 weights are not whole blocks of 256: "
        "`token_embd`; `attn_v` in layers 0-1, "
    ) in markdown


# q4_k_m (the real model's file in the bench and tests/worker/test_real_model.py) in make test; q3_k_m and q2_k, each
# three more passes through llama.cpp's quantizer, in make test-slow
@pytest.mark.parametrize(
    "gguf_type", ["q4_k_m", *(pytest.param(gguf_type, marks=pytest.mark.slow) for gguf_type in ("q3_k_m", "q2_k"))]
)
def test_k_quants_of_a_hidden_size_no_multiple_of_256_are_llama_cpps_own_mix(smollm2_like, tmp_path, gguf_type):
    """Every file of `gguf_type` of SmolLM2's proportions, pruned or dense, holds each tensor in the type llama.cpp's
    own quantizer gives a file of the same shapes, fallbacks included; the bits per weight are llama.cpp's, and the
    file loads and generates."""
    dense, out, _ = smollm2_like
    for name, checkpoint in (("pruned", out), ("dense", dense)):
        exported = export_gguf(checkpoint, tmp_path / f"{name}-{gguf_type}.gguf", gguf_type)
        reference = same_shape_f32(exported.path, tmp_path / f"{name}-{gguf_type}-reference-f32.gguf")
        by_llama_cpp = llama_cpp_quantized(reference, tmp_path / f"{name}-{gguf_type}-reference.gguf", gguf_type)
        assert exported.tensor_types == read_types(by_llama_cpp)[0], name
        assert {fallback.tensor for fallback in exported.fallbacks} >= {"token_embd.weight"}
        size, params = llama_cpp_size(exported.path)
        assert exported.bits_per_weight == pytest.approx(size * 8 / params)
    assert len(generate(exported.path)) == NEW_TOKENS


WITHOUT_LLAMA_CPP = """
import sys
sys.modules["llama_cpp"] = None  # `import llama_cpp` raises ImportError, as without the extra
from casp_core.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


# slow (`make test-slow`): three fresh `casp` processes for an install without the optional llama.cpp
@pytest.mark.slow
def test_without_llama_cpp_a_quantized_gguf_is_refused_up_front_and_f16_still_works(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    def casp(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", WITHOUT_LLAMA_CPP, *args], capture_output=True, text=True, env=env, cwd=REPO
        )

    out = tmp_path / "pruned"
    completed = casp(
        "prune",
        "--model",
        str(STORIES),
        "--ratio",
        "0.3",
        "--out",
        str(out),
        *SMALL,
        "--export",
        "gguf",
        "--gguf-type",
        "q8_0",
    )
    assert completed.returncode == 1
    assert completed.stderr.strip().splitlines()[-1] == f"casp: error: llama_cpp_missing: {LLAMA_CPP_MISSING}"
    assert "loading" not in completed.stderr and not out.exists()
    completed = casp("export", str(STORIES), "--format", "gguf", "--gguf-type", "q4_0", "--out", str(tmp_path / "a"))
    assert completed.returncode == 1 and LLAMA_CPP_MISSING in completed.stderr
    completed = casp("export", str(STORIES), "--format", "gguf", "--out", str(tmp_path / "model-f16.gguf"))
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["tensor_types"] == {"F16": 36, "F32": 11}  # 5 layers x 7 and the embedding


def test_an_explicit_round_to_that_forces_fallbacks_warns_and_the_fallbacks_are_named(tmp_path, capsys):
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(STORIES), "--ratio", "0.3", "--out", str(out), *SMALL, "--round-to", "1"]
    assert main([*arguments, "--export", "gguf", "--gguf-type", "q8_0", "--solver", "diagonal"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("casp: warning: round_to")]
    assert warnings == [f"casp: warning: {fallback_warning([172] * 5, 1, 'q8_0', 32)}"]
    (export,) = json.loads(captured.out)["exports"]
    types, rows, _ = read_types(out / export["path"])
    ffn_fallbacks = [f for f in export["fallbacks"] if "ffn_down" in f["tensor"]]
    expected = [name for name, row in rows.items() if "ffn_down" in name and row % 32]
    assert expected and [f["tensor"] for f in ffn_fallbacks] == expected
    assert all(types[name] == "F16" for name in expected)
    report = json.loads((out / "report.json").read_text())
    assert report["warnings"] == [warnings[0].removeprefix("casp: warning: ")]
    assert report["rounding"]["ffn_multiples"] == [1] * 5
