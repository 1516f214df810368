"""The units CASP prunes in a decoder layer, as the families (casp_core.families), the budget and surgery name them:
query heads grouped over key/value heads, and FFN channels. Plain data, below every module that works on layers."""

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionGeometry:
    """Which key/value head each query head reads (`kv_of_query[q]`), and the head size."""

    head_dim: int
    kv_of_query: tuple[int, ...]
    num_kv_heads: int

    @property
    def num_heads(self) -> int:
        return len(self.kv_of_query)


@dataclass(frozen=True)
class LayerPruning:
    """The units removed from one decoder layer, in the dense layer's numbering."""

    pruned_heads: tuple[int, ...]
    pruned_channels: tuple[int, ...]  # a removed expert's channels among them, every one
    removed_experts: tuple[int, ...] = ()  # a mixture of experts' whole experts (moe.prune_experts), router rows too


def kept(total: int, pruned: tuple[int, ...]) -> list[int]:
    gone = set(pruned)
    return [i for i in range(total) if i not in gone]


def kept_kv_heads(geometry: AttentionGeometry, pruned_heads: tuple[int, ...]) -> list[int]:
    """A key/value head stays while at least one query head that reads it stays."""
    kept_heads = kept(geometry.num_heads, pruned_heads)
    return sorted({geometry.kv_of_query[q] for q in kept_heads})
