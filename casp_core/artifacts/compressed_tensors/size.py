"""The bytes of a checkpoint's weight files of a planned shape, before they are written: the model's dtype, or
compressed-tensors' packing of each decoder projection (casp_core.artifacts.compressed_tensors.quantize, which takes
its group sizes from here). It imports no compressed-tensors: a budget is checked against it at submit.
tests/core/job/sweep/test_size_estimate.py checks it against written files."""

from casp_core.artifacts.shapes import Geometry, PlannedShape

SAFETENSORS_BYTES_PER_TENSOR = 100  # its entry in the JSON header
GROUP_SIZES = (128, 64, 32)  # w4a16's groups, largest first; vLLM's Marlin kernels take these


def safetensors_bytes(geometry: Geometry, shape: PlannedShape, scheme: str) -> int:
    """The checkpoint's weight files: the model's dtype, or compressed-tensors' `scheme` on each projection."""
    h, d, size = geometry.hidden, geometry.head_dim, geometry.dtype_bytes
    data = geometry.other_params * size
    tensors = 3 + 2 * geometry.layers
    for layer in shape.layers:
        projections = [
            (layer.heads * d, h),
            (layer.kv_heads * d, h),
            (layer.kv_heads * d, h),
            (h, layer.heads * d),
            (layer.ffn_width, h),
            (layer.ffn_width, h),
            (h, layer.ffn_width),
        ]
        for rows, row_length in projections:
            data += _projection_bytes(rows, row_length, scheme, size)
        biases = (
            geometry.qkv_bias * (layer.heads + 2 * layer.kv_heads) * d + geometry.o_bias * h
        ) + geometry.mlp_bias * (2 * layer.ffn_width + h)
        data += biases * size
        tensors += 7 * (2 if scheme != "none" else 1)
    return data + tensors * SAFETENSORS_BYTES_PER_TENSOR


def _projection_bytes(rows: int, row_length: int, scheme: str, size: int) -> int:
    if rows == 0 or row_length == 0:
        return 0
    if scheme == "none":
        return rows * row_length * size
    if scheme == "w4a16":
        group = next((group for group in GROUP_SIZES if row_length % group == 0), GROUP_SIZES[-1])
        return rows * row_length // 2 + rows * (row_length // group) * size
    return rows * row_length + rows * size  # int8 or fp8, one scale per output channel
