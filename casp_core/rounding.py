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
"""

AUTO = "auto"
WIDEST_UNIT = 64  # measured to give llama.cpp its prefill speedup at 4096 channels
NARROWEST_UNIT = 8  # below this auto keeps the exact count
UNITS_PER_LAYER = 64  # auto's unit is at most this fraction of the layer's width


def auto_round_to(width: int) -> int:
    unit = WIDEST_UNIT
    while unit > 1 and unit * UNITS_PER_LAYER > width:
        unit //= 2
    return unit if unit >= NARROWEST_UNIT else 1


def round_to_for(width: int, setting: int | str) -> int:
    """The multiple a layer of `width` FFN channels keeps: the setting's, or auto's for that width."""
    return auto_round_to(width) if setting == AUTO else int(setting)


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
