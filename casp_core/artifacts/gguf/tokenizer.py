"""The tokenizer inside a GGUF file, for llama.cpp to tokenize text exactly as transformers does.

The tokenizer is read as transformers loads it, not from `tokenizer.json`: a `LlamaTokenizer` checkpoint gets
transformers' own normalisation whatever the file says (a Metaspace pre-tokenizer with `prepend_scheme`
"first", or "always" with `legacy: true`, in place of a Llama-2 style normalizer).

Supported: SentencePiece-style BPE (a Metaspace pre-tokenizer, optionally after a split that isolates newlines,
or the Llama-2 normalizer that prepends ▁ and replaces spaces; byte fallback or an `<unk>` token), as LLaMA-2,
Mistral and both fixture models use. It is written as llama.cpp's `llama` (SentencePiece) tokenizer, which
merges the adjacent pair whose joined text is the highest-scoring token: scoring each token by minus the rank
of the merge that makes it turns that into BPE's lowest-rank-first order. gguf's `LlamaHfVocab` scores every
token -1000, which merges left to right instead, so the scores are computed here. Byte-level BPE (GPT-2 /
LLaMA-3 / Qwen style) needs llama.cpp's regex pre-tokenizers and is refused.

The space prefix. llama.cpp has one setting, `add_space_prefix`: prepend ▁ to every text, or never. The Llama-2
normalizer does the former, Metaspace with `prepend_scheme` "never" the latter: both are reproduced exactly.
Metaspace "first" and "always" prepend ▁ unless the text already begins with one, which no llama.cpp tokenizer
type can do: the token texts of a SentencePiece tokenization spell its input, and transformers gives " x" and
"x" the same ids while llama.cpp spells them "▁▁x" and "▁x". The export writes `add_space_prefix` (every text
without a leading space tokenizes the same) and says what differs: a text that begins with a space gets one more
▁ in llama.cpp, and the same ids as transformers without that first space.

A checkpoint pruned from a GGUF file (casp_core.artifacts.gguf.source) carries that file's own tokenizer keys
(`SOURCE_VOCABULARY`, written by `keep_source_vocabulary`), and its GGUF gets them unchanged: the vocabulary,
merges, pre-tokenizer and chat template llama.cpp already served from the source, byte-level BPE included, since
pruning leaves the embedding's rows as they were.

What llama.cpp cannot reproduce but text can avoid is returned as the caveat, which the caller shows and the
file carries (`casp.tokenizer_caveat`): that space prefix; NFC normalisation (llama.cpp does not normalise);
no byte fallback (ptbwiki-7M's tokenizer), where transformers turns a character outside the vocabulary into
`<unk>` while llama.cpp's SentencePiece tokenizer looks for byte tokens that do not exist and throws, which stops
the process. Anything else that would tokenize differently is refused before the file is written.
"""

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from casp_core.errors import UnsupportedModel
from casp_core.model import load_tokenizer

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_METASPACE = "▁"
# Llama-2 / Mistral's tokenizer.json: SentencePiece's dummy prefix on every text, spaces as ▁.
_SENTENCEPIECE_NORMALIZER = [
    {"type": "Prepend", "prepend": _METASPACE},
    {"type": "Replace", "pattern": {"String": " "}, "content": _METASPACE},
]
LEADING_SPACE_CAVEAT = (
    "llama.cpp prepends ▁ to every text, transformers not to one that begins with a space, so such a text gets "
    "one more ▁ token at its start in llama.cpp: drop its first space before llama.cpp tokenizes it"
)
NFC_CAVEAT = "transformers normalises text to NFC, llama.cpp does not: give llama.cpp NFC text"
NO_BYTE_FALLBACK_CAVEAT = (
    "the tokenizer has no byte fallback: llama.cpp cannot tokenize a character outside the vocabulary "
    "(transformers gives <unk>), so such text stops llama.cpp; feed it token ids or in-vocabulary text"
)


@dataclass(frozen=True)
class Vocabulary:
    """Everything the file's tokenizer keys hold, read and checked before the file is opened."""

    checkpoint: Path
    tokens: list[str]
    scores: list[float]
    token_types: list[gguf.TokenType]
    add_space_prefix: bool
    bos_id: int | None  # the token transformers puts before every text, None when it adds none
    eos_id: int | None  # the one it puts after
    caveat: str | None  # what llama.cpp tokenizes differently, "; "-joined; None when nothing


@dataclass(frozen=True)
class SourceVocabulary:
    """The tokenizer keys of the GGUF file the checkpoint was pruned from, to be written unchanged."""

    keys: list[dict[str, Any]]  # {"key", "type", "sub_type" (arrays), "value"}, GGUFValueType names
    caveat: None = None  # the file's tokenizer is llama.cpp's own: nothing differs from it


# In a checkpoint pruned from a GGUF file: that file's tokenizer keys.
SOURCE_VOCABULARY = "gguf_tokenizer.json"
TOKENIZER_KEYS = "tokenizer."


def keep_source_vocabulary(gguf_file: Path, checkpoint: Path) -> None:
    """Copy the tokenizer keys of `gguf_file` into `checkpoint` (as `SOURCE_VOCABULARY`), for its GGUF exports."""
    keys = []
    for name, field in gguf.GGUFReader(gguf_file).fields.items():
        if name.startswith(TOKENIZER_KEYS):
            types = [kind.name for kind in field.types]
            keys.append({"key": name, "type": types[0], "sub_type": types[1:2] or None, "value": field.contents()})
    (checkpoint / SOURCE_VOCABULARY).write_text(json.dumps(keys, ensure_ascii=False))


def _source_vocabulary(record: Path, vocab_size: int) -> SourceVocabulary:
    keys = json.loads(record.read_text())
    tokens = next((len(key["value"]) for key in keys if key["key"] == gguf.Keys.Tokenizer.LIST), None)
    if tokens != vocab_size:
        raise _refuse(f"the source GGUF's {tokens} tokens do not match the embedding's {vocab_size} rows")
    return SourceVocabulary(keys)


def _refuse(what: str) -> UnsupportedModel:
    return UnsupportedModel(f"GGUF export: llama.cpp cannot reproduce this tokenizer: {what}")


def _pre_tokenizer_steps(pre_tokenizer: dict[str, Any] | None) -> list[dict[str, Any]]:
    return [] if pre_tokenizer is None else pre_tokenizer.get("pretokenizers", [pre_tokenizer])


def _metaspace(pre_tokenizer: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """The Metaspace step, and whether a step before it isolates newlines (the only other step accepted)."""
    steps = _pre_tokenizer_steps(pre_tokenizer)
    metaspace = [step for step in steps if step.get("type") == "Metaspace"]
    others = [step for step in steps if step.get("type") != "Metaspace"]
    if len(metaspace) != 1:
        kinds = ", ".join(step.get("type", "?") for step in steps) or "none"
        raise _refuse(f"pre-tokenizer {kinds} (only SentencePiece-style Metaspace is supported)")
    for step in others:
        # SentencePiece never merges across a newline unless the vocabulary has such a token, which a
        # BPE trained after this split cannot have: isolating newlines changes nothing for llama.cpp.
        isolates_newline = step.get("type") == "Split" and step.get("behavior") == "Isolated"
        isolates_newline = isolates_newline and step.get("pattern") == {"String": "\n"}
        if not isolates_newline:
            raise _refuse(f"pre-tokenizer step {step.get('type')} {step.get('pattern', '')}")
    if metaspace[0].get("replacement", _METASPACE) != _METASPACE:
        raise _refuse(f"Metaspace replacement {metaspace[0]['replacement']!r}")
    return metaspace[0], bool(others)


def _space_prefix(tokenizer: dict[str, Any]) -> tuple[bool, list[str]]:
    """llama.cpp's `add_space_prefix` for this normalizer and pre-tokenizer, and the caveats it leaves."""
    normalizer = tokenizer.get("normalizer")
    if normalizer is not None and normalizer.get("normalizers") == _SENTENCEPIECE_NORMALIZER:
        if tokenizer.get("pre_tokenizer") is not None:
            kinds = ", ".join(step.get("type", "?") for step in _pre_tokenizer_steps(tokenizer["pre_tokenizer"]))
            raise _refuse(f"pre-tokenizer {kinds} after a normalizer that prepends ▁")
        return True, []  # llama.cpp's own SentencePiece behaviour
    normalizer_type = (normalizer or {}).get("type")
    if normalizer_type not in (None, "NFC"):
        raise _refuse(f"normalizer {normalizer_type}")
    caveats = [NFC_CAVEAT] if normalizer_type == "NFC" else []
    metaspace, splits_newlines = _metaspace(tokenizer.get("pre_tokenizer"))
    scheme = metaspace.get("prepend_scheme", "always")
    if scheme == "never":
        return False, caveats
    if scheme == "always" and splits_newlines:
        raise _refuse(
            "Metaspace prepend_scheme 'always' after a split at newlines: transformers prepends ▁ to every "
            "line, llama.cpp only to the start of the text"
        )
    return True, [LEADING_SPACE_CAVEAT, *caveats]


def _added_specials(tokenizer: Any) -> tuple[int | None, int | None]:
    """The token transformers adds before and after a text, as llama.cpp's BOS and EOS."""
    bare = tokenizer("a", add_special_tokens=False).input_ids
    full = tokenizer("a").input_ids
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            before, after = full[:start], full[start + len(bare) :]
            break
    else:
        raise _refuse(f"its special tokens change the text's own ids ({bare} alone, {full} with them)")
    if len(before) > 1 or len(after) > 1:
        raise _refuse(f"it adds {before} before and {after} after a text; llama.cpp adds one BOS and one EOS")
    return (before[0] if before else None), (after[0] if after else None)


def _token_types(tokenizer: dict[str, Any], vocab: dict[str, int]) -> dict[int, gguf.TokenType]:
    types: dict[int, gguf.TokenType] = {}
    model = tokenizer["model"]
    if model.get("byte_fallback"):
        for text, index in vocab.items():
            if _BYTE_TOKEN.fullmatch(text):
                types[index] = gguf.TokenType.BYTE
    for added in tokenizer.get("added_tokens", []):
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    if model.get("unk_token") in vocab:
        types[vocab[model["unk_token"]]] = gguf.TokenType.UNKNOWN
    return types


def read_vocabulary(checkpoint: Path, vocab_size: int) -> Vocabulary | SourceVocabulary:
    """The checkpoint's tokenizer as llama.cpp will hold it, `vocab_size` rows of the embedding padded as
    llama.cpp expects; refused when llama.cpp would tokenize a text differently in a way text cannot avoid. A
    checkpoint pruned from a GGUF file has that file's (`SOURCE_VOCABULARY`)."""
    if (checkpoint / SOURCE_VOCABULARY).is_file():
        return _source_vocabulary(checkpoint / SOURCE_VOCABULARY, vocab_size)
    return vocabulary_of(load_tokenizer(str(checkpoint)), vocab_size, checkpoint)


def vocabulary_of(loaded: Any, vocab_size: int, checkpoint: Path) -> Vocabulary:
    """`loaded` (a transformers tokenizer, read from `checkpoint`) as llama.cpp will hold it; refused as
    `read_vocabulary` refuses. A job calls it on its source's tokenizer before any work, so that a tokenizer no GGUF
    can carry is refused then, not after the prune."""
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None:
        raise _refuse(f"{type(loaded).__name__} has no tokenizers backend (tokenizer.json)")
    tokenizer = json.loads(backend.to_str())
    model = tokenizer["model"]
    if model.get("type") != "BPE" or model.get("ignore_merges") or model.get("continuing_subword_prefix"):
        raise _refuse(f"model type {model.get('type')} (only SentencePiece-style BPE is supported)")
    add_space_prefix, caveats = _space_prefix(tokenizer)
    bos_id, eos_id = _added_specials(loaded)

    vocab: dict[str, int] = dict(model["vocab"])
    for added in tokenizer.get("added_tokens", []):
        vocab.setdefault(added["content"], added["id"])
    if len(vocab) > vocab_size:
        raise _refuse(f"{len(vocab)} tokens but the embedding has {vocab_size} rows")
    scores = [0.0] * vocab_size
    for rank, merge in enumerate(model.get("merges", [])):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        index = vocab.get(left + right)
        if index is not None and scores[index] == 0.0:
            scores[index] = -float(rank + 1)
    types = _token_types(tokenizer, vocab)
    texts = {index: text for text, index in vocab.items()}
    tokens, token_types = [], []
    for index in range(vocab_size):
        if index in texts:
            tokens.append(texts[index])
            token_types.append(types.get(index, gguf.TokenType.NORMAL))
        else:  # embedding rows beyond the tokenizer, as llama.cpp's converter pads them
            tokens.append(f"[PAD{index}]")
            token_types.append(gguf.TokenType.UNUSED)
    if not model.get("byte_fallback"):
        caveats.append(NO_BYTE_FALLBACK_CAVEAT)
    return Vocabulary(
        checkpoint, tokens, scores, token_types, add_space_prefix, bos_id, eos_id, "; ".join(caveats) or None
    )


def write_vocabulary(writer: gguf.GGUFWriter, vocabulary: Vocabulary | SourceVocabulary) -> None:
    """Tokens, scores, types, the space prefix, special tokens and the caveat; a source GGUF's keys as they were."""
    if isinstance(vocabulary, SourceVocabulary):
        for key in vocabulary.keys:
            sub_type = gguf.GGUFValueType[key["sub_type"][0]] if key["sub_type"] else None
            writer.add_key_value(key["key"], key["value"], gguf.GGUFValueType[key["type"]], sub_type)
        return
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_scores(vocabulary.scores)
    writer.add_token_types(vocabulary.token_types)
    writer.add_add_space_prefix(vocabulary.add_space_prefix)
    vocab_log = logging.getLogger("gguf.vocab")
    level = vocab_log.level
    vocab_log.setLevel(logging.ERROR)  # it warns about the sentence-pair template, which llama.cpp never uses
    try:
        special = gguf.SpecialVocab(vocabulary.checkpoint, load_merges=False, n_vocab=len(vocabulary.tokens))
        # What transformers does, not what the files say: llama.cpp adds BOS and EOS by these keys.
        special.add_special_token = {"bos": vocabulary.bos_id is not None, "eos": vocabulary.eos_id is not None}
        for name, token_id in (("bos", vocabulary.bos_id), ("eos", vocabulary.eos_id)):
            if token_id is not None:
                special.special_token_ids[name] = token_id
        special.add_to_gguf(writer, quiet=True)
    finally:
        vocab_log.setLevel(level)
    if vocabulary.caveat is not None:
        writer.add_string("casp.tokenizer_caveat", vocabulary.caveat)
