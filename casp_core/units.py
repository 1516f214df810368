"""What a decoder layer's prunable units are and which of them go: plain records, importing nothing of casp, so
that the model adapter, surgery and the families (casp_core.families) can all name them without an import cycle."""

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
    pruned_channels: tuple[int, ...]
