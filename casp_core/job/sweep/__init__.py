"""A job with a target (a size or a parameter count) instead of a ratio: `candidates` turns the target into
(ratio, format) candidates with their sizes estimated from the planned `shapes`; `shared_pass` prunes them with the
work they share done once; `run.run_sweep` measures each, picks from the front and writes the pick as a
single-ratio job (docs/budgets.md).
"""
