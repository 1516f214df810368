"""Evaluation, apart from the method: perplexity, zero-shot accuracy, efficiency, behind `evaluate.evaluate`.

The modules load torch, transformers and the harness: import them where a command needs them.
"""
