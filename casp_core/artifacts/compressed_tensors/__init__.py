"""compressed-tensors, the format vLLM loads quantized checkpoints from: `quantize` rewrites a pruned checkpoint
(w8a8_int8, fp8_dynamic, w4a16); `size` its files' bytes before they are written.
"""
