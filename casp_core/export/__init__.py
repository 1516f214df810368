"""Exports of a checkpoint for serving engines other than transformers."""

from casp_core.export.gguf import GGUF_TYPES, GgufExport, export_gguf

__all__ = ["GGUF_TYPES", "GgufExport", "export_gguf"]
