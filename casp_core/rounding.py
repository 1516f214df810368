"""How many FFN channels a layer keeps a multiple of (`round_to`): widths the matrix kernels run at full speed.

A pruned FFN of any width computes the same function, but engines serve some widths much faster than others.
Measured (bench/results/engines.md, llama.cpp f16 on a 2-core AVX-512 CPU, 16 layers of 1536 x 4096 pruned at
0.5): prefill 1.04x of dense with exact counts (round_to 1), 1.74x with multiples of 64; decode 1.80x and 2.14x.
`auto` rounds a layer of `width` FFN channels to the largest power of two up to 64 that is at most width / 64,
so that one rounding unit is at most 1/64 of the layer (the ratio asked for stays reachable to within one unit
of the last layer), and to 1 where that would be below 8 (a multiple that small is taken to buy no kernel
speed, only to cost precision; not measured). Only 1 and 64 were timed; the multiples between (16 at 1024
channels, 32 at 2048) follow the 1/64 rule, not a measurement. The fixtures: stories260K's 172 channels stay
exact, ptbwiki-7M's 704 keep multiples of 8 (the perplexity cost: bench/results/rounding.md).

A job that exports a quantized GGUF rounds to the quantizer's block instead (`block`: 256 for the K-quants, 32
for q8_0, q4_0, q5_0 and iq4_nl), on every layer at least twice the block wide, so that llama.cpp's quantizer
gives each ffn_down its own type: a row of another length falls back to another type (casp_core.artifacts.gguf.types).
Narrower layers keep auto's unit (the block would leave them one or no choice of width).
"""

import math

from casp_core.errors import InvalidConfig
from casp_core.settings import PruneSettings

AUTO = "auto"
WIDEST_UNIT = 64  # measured to give llama.cpp its prefill speedup at 4096 channels
NARROWEST_UNIT = 8  # below this auto keeps the exact count
UNITS_PER_LAYER = 64  # auto's unit is at most this fraction of the layer's width
# llama.cpp quantizer's blocks: a row of a quantized weight is a whole number of them.
SUPER_BLOCK = 256  # QK_K
BLOCK = 32  # QK8_0, QK4_0, QK5_0, QK4_NL
K_QUANTS = ("q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q3_k_m", "q2_k")
BLOCK_32_TYPES = ("q8_0", "q4_0", "q5_0", "iq4_nl")


def auto_round_to(width: int) -> int:
    unit = WIDEST_UNIT
    while unit > 1 and unit * UNITS_PER_LAYER > width:
        unit //= 2
    return unit if unit >= NARROWEST_UNIT else 1


def round_to_for(width: int, setting: int | str, block: int | None = None) -> int:
    """The multiple a layer of `width` FFN channels keeps: the setting's, or auto's for that width (the
    quantizer's `block` where the layer is at least twice as wide)."""
    if setting != AUTO:
        return int(setting)
    return block if block and width >= 2 * block else auto_round_to(width)


def channel_counts(width: int, r_max: float, round_to_setting: int | str, block: int | None = None) -> tuple[int, ...]:
    """The FFN channel counts a layer may prune: at most r_max of them, keeping a positive multiple of round_to
    (the setting's, or auto's for this width and the quantizer's `block`)."""
    round_to = round_to_for(width, round_to_setting, block)
    most = int(r_max * width + 1e-9)
    # Counts that leave a multiple of round_to: width % round_to, then every round_to more.
    counts = tuple(c for c in range(width % round_to, most + 1, round_to) if width - c >= round_to)
    if not counts:
        raise InvalidConfig(
            f"round_to: a layer of {width} FFN channels cannot keep a multiple of {round_to} channels "
            f"while pruning at most r_max = {r_max} of them"
        )
    return counts


def head_multiple(block: int | None, head_dim: int) -> int:
    """How many query heads make o_proj's rows (heads x head_dim) a multiple of the quantizer's block."""
    return block // math.gcd(block, head_dim) if block else 1


def aligned_heads(pruned: float, heads: int, num_heads: int, multiple: int, cap: int) -> int:
    """`heads` pruned query heads moved by one, where that leaves a multiple of `multiple` kept and stays within
    [0, cap]; otherwise `heads` itself (o_proj then takes llama.cpp's fallback type). Of two such counts, the one
    nearer `pruned`, the layer's exact share of heads (r_l x heads), then the one keeping more."""
    if (num_heads - heads) % multiple == 0:
        return heads
    moved = [count for count in (heads - 1, heads + 1) if 0 <= count <= cap and (num_heads - count) % multiple == 0]
    return min(moved, key=lambda count: (abs(count - pruned), count), default=heads)


def speed_warning(widths: list[int], setting: int | str) -> str | None:
    """A one-line warning when an explicit round_to leaves kept widths the kernels run slowly, on layers wide
    enough that auto would have rounded them; None when the setting keeps the speedup (or is auto)."""
    if setting == AUTO:
        return None
    slow = sorted({width for width in widths if int(setting) % auto_round_to(width) and auto_round_to(width) > 1})
    if not slow:
        return None
    wanted = auto_round_to(slow[-1])
    return (
        f"round_to = {setting} keeps FFN widths that are not multiples of {wanted} on layers of "
        f"{slow[-1]} channels: llama.cpp runs such widths slowly, which forfeits much of the "
        f"prefill speedup (round_to auto, the default, picks {wanted} there; bench/results/engines.md)"
    )


def fallback_warning(widths: list[int], setting: int | str, gguf_type: str | None, block: int | None) -> str | None:
    """A one-line warning when an explicit round_to leaves kept FFN widths that are not multiples of the
    quantizer's block on layers wide enough for auto to fit it: their ffn_down falls back to another type."""
    if setting == AUTO or block is None or int(setting) % block == 0:
        return None
    wide = [width for width in widths if width >= 2 * block]
    if not wide:
        return None
    return (
        f"round_to = {setting} keeps FFN widths that are not multiples of {block}, the block of {gguf_type}: "
        f"llama.cpp's quantizer gives the ffn_down weights of such layers a fallback type (named in the report's "
        f"exports), not {gguf_type}'s (round_to auto, the default, picks {block} on layers of {min(wide)} channels "
        "or more)"
    )


def block_of(gguf_type: str) -> int | None:
    """The row multiple llama.cpp's quantizer needs for `gguf_type`'s own weights; None for the float types."""
    if gguf_type in K_QUANTS:
        return SUPER_BLOCK
    return BLOCK if gguf_type in BLOCK_32_TYPES else None


def quantizer_block(settings: PruneSettings) -> int | None:
    """The block a job's widths should fit: that of its GGUF type when it exports a quantized GGUF, else None."""
    return block_of(settings.gguf_type) if settings.exports_gguf else None
