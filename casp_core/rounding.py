"""How many FFN channels a layer keeps a multiple of (`round_to`): the widths the matrix kernels run at full speed.

A pruned FFN of any width computes the same function, but engines serve some widths much faster than others:
llama.cpp's f16 CPU kernels (and GPU tensor cores) work on blocks of 8 to 64 columns, and a width that is not a
multiple falls back to a slower path, which cost most of the prefill gain in bench/results/engines.md. `auto`
rounds a layer of `width` FFN channels to the largest power of two up to 64 that is at most width / 64, so that
one rounding unit is at most 1/64 of the layer (the ratio asked for stays reachable to within one unit of the
last layer), and to 1 where that would be below 8: no kernel gains from a finer multiple, so it would only
cost precision (both fixture models: 172 and 704 channels stay at 1 and 8).
"""

AUTO = "auto"
WIDEST_UNIT = 64  # the largest multiple a kernel asks for (bench/results/engines.md)
NARROWEST_UNIT = 8  # below this no kernel benefits, so auto keeps the exact count
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
        f"{slow[-1]} channels: llama.cpp and GPU kernels run such widths slowly, which forfeits much of the "
        f"prefill speedup (round_to auto, the default, picks {wanted} there; bench/results/engines.md)"
    )
