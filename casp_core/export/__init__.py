"""Exports of a checkpoint for serving engines other than transformers: `casp_core.export.gguf` (llama.cpp).

This package's import stays light (no torch, no gguf), so the command line can register `casp export` cheaply.
"""
