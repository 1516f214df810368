"""The tokenizer inside a GGUF file, for llama.cpp to tokenize text exactly as transformers does.

Supported: a `tokenizer.json` BPE in the SentencePiece style (Metaspace pre-tokenizer, optionally after a split
that isolates newlines; byte fallback or an `<unk>` token), as LLaMA-2, Mistral and both fixture models use.
It is written as llama.cpp's `llama` (SentencePiece) tokenizer, which merges the adjacent pair whose joined text
is the highest-scoring token: scoring each token by minus the rank of the merge that makes it turns that into
BPE's lowest-rank-first order. gguf's `LlamaHfVocab` scores every token -1000, which merges left to right
instead, so the scores are computed here. Byte-level BPE (GPT-2 / LLaMA-3 / Qwen style) needs llama.cpp's
regex pre-tokenizers and is refused.

Without byte fallback (ptbwiki-7M's tokenizer) transformers turns a character outside the vocabulary into
`<unk>`, while llama.cpp's SentencePiece tokenizer looks for byte tokens that do not exist and throws, which
stops the process. Text made of the vocabulary's characters tokenizes the same; `write_vocabulary` returns
that caveat so the caller can show it and the file carries it (`casp.tokenizer_caveat`).
"""

import json
import logging
import re
from pathlib import Path
from typing import Any

import gguf

from casp_core.errors import UnsupportedModel

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Normalizers that leave already-normalised text unchanged; llama.cpp does not normalise.
_ACCEPTED_NORMALIZERS = (None, "NFC")


def _refuse(what: str) -> UnsupportedModel:
    return UnsupportedModel(f"GGUF export: llama.cpp cannot reproduce this tokenizer: {what}")


def _metaspace(pre_tokenizer: dict[str, Any] | None) -> dict[str, Any]:
    """The Metaspace step, after checking that any other step only isolates newlines."""
    steps = [] if pre_tokenizer is None else pre_tokenizer.get("pretokenizers", [pre_tokenizer])
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
    if metaspace[0].get("replacement", "▁") != "▁":
        raise _refuse(f"Metaspace replacement {metaspace[0]['replacement']!r}")
    return metaspace[0]


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


def write_vocabulary(writer: gguf.GGUFWriter, checkpoint: Path, vocab_size: int) -> str | None:
    """Tokens, scores, types and special tokens; `vocab_size` rows of the embedding, padded as llama.cpp expects.

    Returns what llama.cpp's tokenizer does differently, or None when it tokenizes every text the same."""
    path = checkpoint / "tokenizer.json"
    if not path.is_file():
        raise _refuse(f"no tokenizer.json in {checkpoint}")
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    model = tokenizer["model"]
    if model.get("type") != "BPE" or model.get("ignore_merges") or model.get("continuing_subword_prefix"):
        raise _refuse(f"model type {model.get('type')} (only SentencePiece-style BPE is supported)")
    normalizer = (tokenizer.get("normalizer") or {}).get("type")
    if normalizer not in _ACCEPTED_NORMALIZERS:
        raise _refuse(f"normalizer {normalizer}")
    metaspace = _metaspace(tokenizer.get("pre_tokenizer"))

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

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(token_types)
    writer.add_add_space_prefix(metaspace.get("prepend_scheme", "always") != "never")
    vocab_log = logging.getLogger("gguf.vocab")
    level = vocab_log.level
    vocab_log.setLevel(logging.ERROR)  # it warns about the sentence-pair template, which llama.cpp never uses
    try:
        gguf.SpecialVocab(checkpoint, load_merges=False, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)
    finally:
        vocab_log.setLevel(level)
    if model.get("byte_fallback"):
        return None
    caveat = (
        "the tokenizer has no byte fallback: llama.cpp cannot tokenize a character outside the vocabulary "
        "(transformers gives <unk>), so such text stops llama.cpp; feed it token ids or in-vocabulary text"
    )
    writer.add_string("casp.tokenizer_caveat", caveat)
    return caveat
