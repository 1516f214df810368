"""LLaMA shapes the benches and the tests build random models from, named once."""

from typing import Any

from transformers import LlamaConfig


def llama_config(
    *, hidden: int, layers: int, ffn: int, heads: int, vocab: int, kv_heads: int | None = None, **extra: Any
) -> LlamaConfig:
    """A LLaMA of these sizes, untied head, 4096 positions; `extra` sets or overrides any other config field."""
    settings: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads or heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    return LlamaConfig(**{**settings, **extra})


def llama2_7b_config(**extra: Any) -> LlamaConfig:
    """LLaMA2-7B's shapes: the paper's appendix counts 6.74 B parameters and 845.71 G MACs for 128 tokens."""
    return llama_config(hidden=4096, layers=32, ffn=11008, heads=32, vocab=32000, **extra)
