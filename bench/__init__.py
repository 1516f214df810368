"""CASP benchmarks: quality (perplexity, objective) and speed (stage timings, memory)."""
