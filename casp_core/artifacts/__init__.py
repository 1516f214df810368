"""Everything casp writes and reads back: the pruned checkpoint (`checkpoint`), the snapshot a retried job resumes
from (`snapshot`), `casp upgrade` of an earlier casp's checkpoint (`upgrade`, verified by `probe` in fresh
processes), what is computed once per model and reused (`caches`, `dense_cache`), and the formats apart from the
checkpoint: `gguf/` (llama.cpp) and `compressed_tensors/` (vLLM), each with the size of its files estimated before
they are written from the shape in `shapes`.
"""
