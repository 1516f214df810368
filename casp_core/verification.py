"""The rule by which a pruned model must reproduce its masked original before it is published.

`pipeline.verify` applies it; the report states it.
"""

import math
from dataclasses import dataclass

from casp_core.errors import VerificationFailed

# Masked and pruned stages, both in float64, differ only in the order their sums are rounded (the masked model
# adds the removed units as exact zeros): measured at 3e-16 to 7e-15 of a stage's largest output, so 1e-10
# leaves four orders of magnitude for wider layers. One weight element changed by a relative 1e-6, about
# ten float32 steps, moves its layer's output by 1e-9 to 1e-8 of that scale, far above the bound.
VERIFY_RELATIVE_TOLERANCE = 1e-10
VERIFY_RULE = (
    "float64, stage by stage on the same input (embeddings, each decoder layer, final norm + head): "
    f"max |masked - pruned| <= {VERIFY_RELATIVE_TOLERANCE:g} x max |masked output| of that stage"
)


@dataclass
class Verification:
    """The largest masked-vs-pruned difference over the stages, absolute and relative to the stage's output."""

    max_abs_diff: float = 0.0
    max_relative_diff: float = 0.0

    def check(self, stage: str, difference: float, scale: float) -> None:
        relative = difference / scale if scale > 0 else (0.0 if difference == 0 else math.inf)
        self.max_abs_diff = max(self.max_abs_diff, difference)
        self.max_relative_diff = max(self.max_relative_diff, relative)
        if not relative <= VERIFY_RELATIVE_TOLERANCE:
            raise VerificationFailed(
                f"{stage} of the pruned model differs from the masked model by {difference:.3g} in float64, "
                f"{relative:.3g} of its largest output magnitude {scale:.3g} (allowed {VERIFY_RELATIVE_TOLERANCE:g})"
            )
