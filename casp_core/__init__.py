"""casp_core: Correlation-Aware Structured Pruning, as a library.

Stages, one module each: model (adapter), data, statistics, interaction, allocation, solvers, surgery,
checkpoint, perplexity, report; `pipeline` composes them.
"""
