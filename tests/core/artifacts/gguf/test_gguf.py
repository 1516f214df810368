"""GGUF export against the real engine: llama-cpp-python must compute what transformers computes.

Both fixture models, dense, pruned by the pipeline at 0.3 and 0.5, and pruned by hand so that the awkward
shapes certainly occur (uneven GQA groups, a layer without heads, one without FFN channels, one with neither).
The bounds for the lossy settings were measured on these checkpoints (docs/serving.md has the numbers).
"""

import hashlib
import json
import unicodedata
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
import tokenizers
import torch

from casp_core.artifacts.checkpoint import load_pruned, save_pruned
from casp_core.artifacts.gguf.tokenizer import LEADING_SPACE_CAVEAT, NFC_CAVEAT, NO_BYTE_FALLBACK_CAVEAT
from casp_core.artifacts.gguf.writer import LayerShape, attention_layout, export_gguf
from casp_core.cli.main import main
from casp_core.data import evaluation_source, load_rows
from casp_core.errors import InvalidConfig, UnsupportedExport, UnsupportedModel
from casp_core.method.prune import prune
from casp_core.method.surgery import LayerPruning, remove_units
from casp_core.model import load_model, load_tokenizer
from casp_core.settings import CalibrationConfig
from tests.conftest import DATASETS_DIR, PTBWIKI, STORIES, small_config

CALIBRATION = CalibrationConfig(dataset="wikitext2:validation", n_samples=8, seq_len=64, batch_size=8)
POSITIONS = 320  # tokens compared per checkpoint: a few hundred positions
THREADS = 2

# max |llama.cpp - transformers| / max |transformers logit|, and greedy agreement, per setting
EXACT = {"relative": 1e-4, "agreement": 0.99}
LOSSY = {  # measured maximum over the checkpoints, about half the bound: see docs/serving.md
    ("f16", "f32"): {"relative": 3e-3, "agreement": 0.99},
    ("bf16", "f32"): {"relative": 3e-2, "agreement": 0.97},
    ("q8_0", "f32"): {"relative": 6e-2, "agreement": 0.93},
    ("f32", "default"): {"relative": 1e-2, "agreement": 0.98},
    ("f16", "default"): {"relative": 1e-2, "agreement": 0.98},
}

# Pruned by hand (dense numbering). stories260K: 8 query heads over 4 key/value heads in pairs, FFN 172.
STORIES_MASKS = [
    LayerPruning((2,), tuple(range(40))),  # key/value head 1 keeps one query head, the others two: uneven
    LayerPruning(tuple(range(8)), ()),  # no heads
    LayerPruning((0, 1, 2, 3, 4), tuple(range(172))),  # heads 5, 6, 7 over two key/value heads; no FFN
    LayerPruning(tuple(range(8)), tuple(range(172))),  # nothing left
    LayerPruning((1, 3, 5, 7), tuple(range(0, 172, 3))),
]
# ptbwiki-7M: 8 heads, 8 key/value heads, FFN 704, 8 layers.
PTBWIKI_MASKS = [
    LayerPruning(tuple(range(8)), ()),
    LayerPruning((), tuple(range(704))),
    LayerPruning(tuple(range(8)), tuple(range(704))),
    LayerPruning((0, 5), tuple(range(0, 704, 5))),
    *[LayerPruning((), ())] * 4,
]
MODELS = {"stories260K": (STORIES, STORIES_MASKS), "ptbwiki-7M": (PTBWIKI, PTBWIKI_MASKS)}
VARIANTS = ("dense", "0.3", "0.5", "by_hand")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every (model, variant) checkpoint directory, built once for the module."""
    root = tmp_path_factory.mktemp("checkpoints")
    built = {}
    for name, (dense_dir, masks) in MODELS.items():
        built[name, "dense"] = dense_dir
        for ratio in ("0.3", "0.5"):
            model, tokenizer = load_model(str(dense_dir), dtype="float32")
            result = prune(model, tokenizer, small_config(float(ratio), calibration=CALIBRATION))
            save_pruned(result.model, tokenizer, root / f"{name}-{ratio}")
            built[name, ratio] = root / f"{name}-{ratio}"
        model, tokenizer = load_model(str(dense_dir), dtype="float32")
        save_pruned(remove_units(model, masks), tokenizer, root / f"{name}-by_hand")
        built[name, "by_hand"] = root / f"{name}-by_hand"
    return built


def reference(checkpoint: Path) -> tuple[torch.nn.Module, object]:
    if checkpoint in (STORIES, PTBWIKI):
        return load_model(str(checkpoint), dtype="float32")
    return load_pruned(checkpoint, dtype="float32")


def evaluation_text() -> str:
    return "\n".join(load_rows(evaluation_source("wikitext2"), str(DATASETS_DIR))[:80])


def engine(path: Path, n_ctx: int, cache: str = "f32") -> llama_cpp.Llama:
    kwargs = {}
    if cache == "f32":
        kwargs = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        logits_all=True,
        n_threads=THREADS,
        verbose=False,
        **kwargs,
    )


def compare(checkpoint: Path, gguf_path: Path, cache: str = "f32") -> dict[str, float]:
    model, tokenizer = reference(checkpoint)
    ids = tokenizer(evaluation_text()).input_ids[:POSITIONS]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    llm = engine(gguf_path, len(ids), cache)
    llm.eval(ids)
    actual = np.asarray(llm.scores[: len(ids)])
    llm.close()
    return {
        "relative": float(np.abs(actual - expected).max() / np.abs(expected).max()),
        "agreement": float((actual.argmax(-1) == expected.argmax(-1)).mean()),
    }


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", MODELS)
def test_f32_logits_match_transformers(checkpoints, tmp_path, name, variant):
    checkpoint = checkpoints[name, variant]
    exported = export_gguf(checkpoint, tmp_path / "model.gguf", "f32")
    measured = compare(checkpoint, exported.path)
    assert measured["relative"] <= EXACT["relative"], measured
    assert measured["agreement"] >= EXACT["agreement"], measured


# slow (`make test-slow`): the toy models' bounds behind docs/serving.md's table; `make test` keeps the f32 export
# exact above and the real model's q4_k_m within its factor (tests/worker/test_real_model.py).
@pytest.mark.slow
@pytest.mark.parametrize(("gguf_type", "cache"), list(LOSSY))
@pytest.mark.parametrize("variant", ("dense", "0.5"))
@pytest.mark.parametrize("name", MODELS)
def test_lossy_settings_stay_within_their_documented_bounds(checkpoints, tmp_path, name, variant, gguf_type, cache):
    checkpoint = checkpoints[name, variant]
    exported = export_gguf(checkpoint, tmp_path / "model.gguf", gguf_type)
    measured = compare(checkpoint, exported.path, cache)
    bound = LOSSY[gguf_type, cache]
    assert measured["relative"] <= bound["relative"], measured
    assert measured["agreement"] >= bound["agreement"], measured


def test_the_hand_pruned_shapes_are_the_awkward_ones(checkpoints, tmp_path):
    exported = export_gguf(checkpoints["stories260K", "by_hand"], tmp_path / "model.gguf", "f32")
    reader = gguf.GGUFReader(exported.path)
    heads = reader.get_field("deci.attention.head_count").contents()
    kv_heads = reader.get_field("deci.attention.head_count_kv").contents()
    widths = reader.get_field("deci.feed_forward_length").contents()
    assert heads == [7, 0, 3, 0, 4]
    assert kv_heads == [7, 0, 3, 0, 4]  # uneven groups: one key/value head per query head
    assert widths == [132, 172, 1, 1, 114]  # no channels: one channel of zeros
    assert exported.kv_repeated_layers == (0, 2)
    assert exported.architecture == "deci"
    assert "blk.1.attn_q.weight" not in exported.tensor_types


def test_uneven_groups_repeat_each_key_value_head_per_gcd_of_group_sizes():
    layout = attention_layout(LayerShape((0, 0, 0, 0, 1, 1, 2, 2), 3, 8))
    assert layout.query_order == tuple(range(8))
    assert layout.kv_heads == (0, 0, 1, 2)
    shuffled = attention_layout(LayerShape((1, 0, 1, 0), 2, 8))
    assert shuffled.query_order == (1, 3, 0, 2) and shuffled.kv_heads == (0, 1)
    assert not shuffled.repeated


def in_vocabulary(text: str, tokenizer) -> bool:
    """Every character is a token of its own or part of one: what a tokenizer without byte fallback can take."""
    characters = {c for token in tokenizer.get_vocab() for c in token.replace("▁", " ")} | {" ", "\n"}
    return set(text) <= characters


# Leading, double and trailing spaces, newlines, digits, non-ASCII (beyond ptbwiki-7M's vocabulary: filtered).
PROBE_TEXTS = (
    "the cat sat",
    " the cat sat",
    "  the cat sat",
    "the  cat   sat",
    "the cat sat ",
    "the cat\nsat",
    "the cat\n sat\n",
    "\nthe cat",
    " \n\nthe cat",
    "the 12 cats and 345 dogs in 1984",
    " 7 days",
    "naïve café, déjà vu",
    " über straße",
    "日本語のテキスト",
    "  ",
    "",
)


def mismatches(llm: llama_cpp.Llama, tokenizer, texts: list[str], caveat: str | None) -> list[str]:
    """The texts whose llama.cpp ids differ from transformers' after what the caveat says to do (its drop of a
    leading space is checked to be needed: the plain text must differ)."""
    drops_leading_space = caveat is not None and LEADING_SPACE_CAVEAT in caveat
    wrong = []
    for text in texts:
        expected = tokenizer(text).input_ids
        given = text
        if drops_leading_space and text.startswith(" "):
            if llm.tokenize(text.encode("utf-8"), add_bos=True) == expected:
                wrong.append(f"{text!r} (the same ids with its leading space)")
            given = text[1:]
        if llm.tokenize(given.encode("utf-8"), add_bos=True) != expected:
            wrong.append(repr(text))
    return wrong


def comparable(text: str, tokenizer) -> bool:
    """Text without a special token written out: transformers reads `<unk>` as the token, llama.cpp as text."""
    return not any(special in text for special in tokenizer.all_special_tokens)


# ptbwiki-7M's 2000 texts (40 s) are `make test-slow`'s; stories260K's run in make test with the same caveat of the
# leading space, and the real model's tokenizer is read from its own file
# (tests/core/artifacts/gguf/test_gguf_source.py).
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if name == "ptbwiki-7M" else name for name in MODELS]
)
def test_llama_cpp_tokenizes_as_transformers_does_or_as_the_caveat_says(tmp_path, name):
    dense_dir = MODELS[name][0]
    exported = export_gguf(dense_dir, tmp_path / "model.gguf", "f16")
    _, tokenizer = load_model(str(dense_dir))
    llm = llama_cpp.Llama(model_path=str(exported.path), vocab_only=True, verbose=False)
    rows = [row for source in ("wikitext2", "ptb") for row in load_rows(evaluation_source(source), str(DATASETS_DIR))]
    texts = [row for row in rows if row.strip()][:2000]  # WikiText-2's rows begin with a space, PTB's do not
    texts += ["\n".join(rows[:200]), *PROBE_TEXTS]
    texts = [text for text in texts if comparable(text, tokenizer)]
    if NO_BYTE_FALLBACK_CAVEAT in exported.tokenizer_caveat:  # ptbwiki-7M: only text of the vocabulary's characters
        texts = [text for text in texts if in_vocabulary(text, tokenizer)]
    assert len(texts) >= 1000 and sum(text.startswith(" ") for text in texts) >= 300
    assert LEADING_SPACE_CAVEAT in exported.tokenizer_caveat  # both: Metaspace, prepend_scheme "first"
    wrong = mismatches(llm, tokenizer, texts, exported.tokenizer_caveat)
    # A text of one space: transformers gives ▁ alone, llama.cpp ▁▁ for it and nothing for the empty text.
    assert llm.tokenize(b" ", add_bos=True) == [*tokenizer(" ").input_ids, tokenizer.convert_tokens_to_ids("▁")]
    llm.close()
    assert not wrong, f"{len(wrong)} of {len(texts)} differ, first: {wrong[:3]}"


def test_a_special_token_written_out_is_text_to_llama_cpp(tmp_path):
    """docs/serving.md names this difference; if llama.cpp ever tokenizes it like transformers, the docs must change."""
    exported = export_gguf(PTBWIKI, tmp_path / "model.gguf", "f16")
    _, tokenizer = load_model(str(PTBWIKI))
    llm = llama_cpp.Llama(model_path=str(exported.path), vocab_only=True, verbose=False)
    unk = "the <unk> sat"
    assert tokenizer(unk).input_ids.count(tokenizer.unk_token_id) == 1
    assert tokenizer.unk_token_id not in llm.tokenize(unk.encode(), add_bos=True, special=False)
    llm.close()


def tokenizer_variant(directory: Path, source: Path, edit: dict, config: dict) -> Path:
    """`source`'s weights with its tokenizer.json changed by `edit` (top-level keys) and `config` as its
    tokenizer_config.json (PreTrainedTokenizerFast: transformers takes tokenizer.json as it is)."""
    directory.mkdir()
    for item in source.iterdir():
        if item.name not in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
            (directory / item.name).symlink_to(item.resolve())
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    (directory / "tokenizer.json").write_text(json.dumps({**tokenizer, **edit}), encoding="utf-8")
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


FAST = {"tokenizer_class": "PreTrainedTokenizerFast"}
SENTENCEPIECE_NORMALIZER = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
    ],
}
METASPACE = {"type": "Metaspace", "replacement": "▁", "split": False}
WITH_EOS = {
    "type": "TemplateProcessing",
    "single": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}},
        {"SpecialToken": {"id": "</s>", "type_id": 0}},
    ],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {
        token: {"id": token, "ids": [index], "tokens": [token]} for token, index in (("<s>", 1), ("</s>", 2))
    },
}
# stories260K's tokenizer.json and tokenizer_config.json changed, and what llama.cpp then tokenizes differently.
VARIANTS = {
    "llama2_normalizer": ({"normalizer": SENTENCEPIECE_NORMALIZER, "pre_tokenizer": None}, FAST, []),
    "prepend_never": ({"pre_tokenizer": {**METASPACE, "prepend_scheme": "never"}}, FAST, []),
    "prepend_always": ({"pre_tokenizer": {**METASPACE, "prepend_scheme": "always"}}, FAST, [LEADING_SPACE_CAVEAT]),
    "adds_eos": ({"post_processor": WITH_EOS}, FAST, [LEADING_SPACE_CAVEAT]),
    # no BOS either: llama.cpp's SentencePiece tokenizer adds one unless the file says not to
    "adds_nothing": ({"post_processor": None}, FAST, [LEADING_SPACE_CAVEAT]),
    "nfc": ({"normalizer": {"type": "NFC"}}, FAST, [LEADING_SPACE_CAVEAT, NFC_CAVEAT]),
    # transformers' LlamaTokenizer replaces the file's normalizer by Metaspace "first" (or "always" with legacy)
    "llama_tokenizer_class": (
        {"normalizer": SENTENCEPIECE_NORMALIZER, "pre_tokenizer": None},
        {"tokenizer_class": "LlamaTokenizer", "legacy": True},
        [LEADING_SPACE_CAVEAT],
    ),
}


# slow (`make test-slow`): seven variants of one tokenizer; `make test` keeps both fixtures' own tokenizers above.
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_space_prefix_and_specials_follow_the_tokenizer_as_transformers_loads_it(tmp_path, variant):
    edit, config, caveats = VARIANTS[variant]
    directory = tokenizer_variant(tmp_path / variant, STORIES, edit, config)
    exported = export_gguf(directory, tmp_path / "model.gguf", "f16")
    tokenizer = load_tokenizer(str(directory))
    assert exported.tokenizer_caveat == ("; ".join(caveats) or None)
    llm = llama_cpp.Llama(model_path=str(exported.path), vocab_only=True, verbose=False)
    texts = list(PROBE_TEXTS)
    if NFC_CAVEAT in caveats:
        decomposed = "cafe\u0301"  # transformers composes é; llama.cpp takes e and the accent apart
        assert llm.tokenize(decomposed.encode(), add_bos=True) != tokenizer(decomposed).input_ids
        texts.append(unicodedata.normalize("NFC", decomposed))
    if variant == "adds_eos":
        assert tokenizer("a").input_ids[-1] == tokenizer.eos_token_id
    if variant == "adds_nothing":
        assert tokenizer("a").input_ids == tokenizer("a", add_special_tokens=False).input_ids
    wrong = mismatches(llm, tokenizer, texts, exported.tokenizer_caveat)
    llm.close()
    assert not wrong, wrong


def test_a_tokenizer_llama_cpp_cannot_reproduce_is_refused_naming_the_difference(tmp_path):
    always = {"pre_tokenizer": json.loads((PTBWIKI / "tokenizer.json").read_text())["pre_tokenizer"]}
    always["pre_tokenizer"]["pretokenizers"][1]["prepend_scheme"] = "always"  # ▁ on every line
    directory = tokenizer_variant(tmp_path / "always", PTBWIKI, always, FAST)
    tokenizer = load_tokenizer(str(directory))
    assert tokenizer.convert_ids_to_tokens(tokenizer("a\nb").input_ids) == ["<s>", "▁a", "▁", "\n", "▁b"]
    with pytest.raises(UnsupportedModel, match="prepend_scheme 'always' after a split at newlines"):
        export_gguf(directory, tmp_path / "always.gguf")
    assert not (tmp_path / "always.gguf").exists()


def test_a_byte_level_bpe_tokenizer_is_refused_naming_the_difference(tmp_path):
    byte_level = tokenizers.Tokenizer(tokenizers.models.BPE())
    byte_level.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet, show_progress=False
    )
    byte_level.train_from_iterator(load_rows(evaluation_source("wikitext2"), str(DATASETS_DIR))[:500], trainer)
    edit = json.loads(byte_level.to_str())
    directory = tokenizer_variant(tmp_path / "byte_level", STORIES, edit, FAST)
    tokenizer = load_tokenizer(str(directory))
    assert tokenizer(" the cat").input_ids[:2] == [1, tokenizer.convert_tokens_to_ids("Ġthe")]  # byte-level indeed
    with pytest.raises(UnsupportedModel, match="pre-tokenizer ByteLevel"):
        export_gguf(directory, tmp_path / "byte_level.gguf")
    assert not (tmp_path / "byte_level.gguf").exists()


def test_the_caveats_are_returned_and_written_into_the_file(tmp_path):
    assert export_gguf(STORIES, tmp_path / "stories.gguf").tokenizer_caveat == LEADING_SPACE_CAVEAT
    exported = export_gguf(PTBWIKI, tmp_path / "ptbwiki.gguf")
    assert exported.tokenizer_caveat == f"{LEADING_SPACE_CAVEAT}; {NFC_CAVEAT}; {NO_BYTE_FALLBACK_CAVEAT}"
    assert gguf.GGUFReader(exported.path).get_field("casp.tokenizer_caveat").contents() == exported.tokenizer_caveat


def test_q8_0_keeps_f16_where_rows_are_not_a_multiple_of_32(checkpoints, tmp_path):
    exported = export_gguf(checkpoints["stories260K", "by_hand"], tmp_path / "model.gguf", "q8_0")
    types = {tensor.name: tensor.tensor_type.name for tensor in gguf.GGUFReader(exported.path).tensors}
    assert types == exported.tensor_types
    fallen_back = {fallback.tensor for fallback in exported.fallbacks}
    assert "blk.0.ffn_down.weight" in fallen_back  # 132 channels
    assert fallen_back == {name for name, kind in types.items() if kind == "F16"}
    assert types["blk.0.ffn_down.weight"] == "F16"
    assert types["blk.0.ffn_up.weight"] == "Q8_0"  # rows of hidden size 64


def test_casp_export_writes_the_file_and_prints_its_digest(tmp_path, capsys):
    out = tmp_path / "dense.gguf"
    assert main(["export", str(STORIES), "--format", "gguf", "--gguf-type", "q8_0", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert printed["architecture"] == "llama" and printed["tensor_types"] == {"Q8_0": 31, "F16": 5, "F32": 11}
    # ffn_down's rows are the dense FFN width, 172: no multiple of 32.
    assert printed["fallbacks"] == [
        {"tensor": f"blk.{layer}.ffn_down.weight", "type": "F16", "wanted": "Q8_0", "row_length": 172, "block": 32}
        for layer in range(5)
    ]
    assert main(["export", str(tmp_path), "--format", "gguf", "--out", str(out)]) == 2
    assert "model_not_found" in capsys.readouterr().err


# Logits llama.cpp and transformers compute in float32 differ by up to about 0.01 on these models.
TIE_MARGIN = 0.02


def test_casp_prune_export_gguf_generates_the_text_transformers_generates(tmp_path, capsys):
    out = tmp_path / "pruned"
    arguments = ["prune", "--model", str(STORIES), "--ratio", "0.5", "--out", str(out), "--export", "gguf"]
    arguments += ["--gguf-type", "f32", "--calibration-dataset", "wikitext2:validation", "--n-samples", "8"]
    arguments += ["--seq-len", "64", "--perplexity", "", "--datasets-dir", str(DATASETS_DIR)]
    assert main(arguments) == 0
    (export,) = json.loads(capsys.readouterr().out)["exports"]
    gguf_path = out / "model-f32.gguf"
    assert export["path"] == gguf_path.name
    assert export["sha256"] == hashlib.sha256(gguf_path.read_bytes()).hexdigest()

    model, tokenizer = load_pruned(out, dtype="float32")
    prompt = tokenizer("Once upon a time").input_ids
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[0]
        logits = model(expected[None]).logits[0, len(prompt) - 1 : -1]
    # Teacher-forced on transformers' greedy text, llama.cpp picks the same next token at every step, but where
    # transformers' two best logits are closer than the engines' float32 difference (a tie either may break).
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=128, n_threads=THREADS, logits_all=True, verbose=False)
    llm.eval(expected[:-1].tolist())
    engine = torch.tensor(llm.scores[len(prompt) - 1 : len(expected) - 1])
    llm.close()
    continuation = expected[len(prompt) :]
    top2 = logits.topk(2).values
    ties = (top2[:, 0] - top2[:, 1]) < TIE_MARGIN
    assert (engine - logits).abs().max() < TIE_MARGIN
    assert torch.all((engine.argmax(-1) == continuation) | ties)
    assert ties.sum() <= 2  # 48 steps compared, not waved through as ties


def test_unsupported_settings_are_refused_in_one_line(tmp_path):
    with pytest.raises(InvalidConfig, match="gguf_type"):
        export_gguf(STORIES, tmp_path / "model.gguf", "q3_k")
    config_path = tmp_path / "qwen3" / "config.json"
    config_path.parent.mkdir()
    for item in STORIES.iterdir():
        (config_path.parent / item.name).symlink_to(item)
    (config_path.parent / "config.json").unlink()
    config_path.write_text((STORIES / "config.json").read_text().replace('"llama"', '"qwen3"'))
    with pytest.raises(UnsupportedExport, match="qwen3"):
        export_gguf(config_path.parent, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()
