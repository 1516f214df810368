"""The `casp` command's library half: `casp prune`, `eval`, `export`, `recover` and `upgrade`, their flags made
from the settings. Heavy imports happen inside the commands that need them.
"""
