"""Non-finite numbers stop the job where they first appear, naming the stage and the decoder layer."""

import torch

from casp_core.errors import NumericalError

ADVICE = (
    "float16 overflows easily: try --dtype bfloat16 or float32; if the model already runs in one of those, "
    "check the checkpoint's weights for NaN or infinity"
)


def check_finite(values: torch.Tensor, stage: str, what: str, layer: int | None) -> None:
    """Raise `NumericalError` when `values` hold NaN or infinity; `layer` None means not one layer's."""
    if bool(torch.isfinite(values).all()):
        return
    where = f"decoder layer {layer}" if layer is not None else "the final norm and head"
    kind = "NaN" if bool(values.isnan().any()) else "infinity"
    raise NumericalError(f"{stage}: {kind} in {what} of {where}. {ADVICE}")
