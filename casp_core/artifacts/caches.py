"""Where casp_core keeps what it computes once per model and reuses: a folder it is given (the service's under
CASP_HOME), by default `$CASP_CACHE_DIR`, else `~/.cache/casp`. Each purpose has its subfolder: `gguf/` the GGUF
sources dequantized (casp_core.artifacts.gguf.source), `dense-evaluation/` the dense models' evaluations."""

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """`$CASP_CACHE_DIR`, else `~/.cache/casp`."""
    configured = os.environ.get("CASP_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "casp"
