"""Llama 1/2/3/3.x: the reference family (casp_core.families.base), with nothing to change."""

from casp_core.families.base import Family


class Llama(Family):
    """LLaMA itself: every method is the base class's."""


LLAMA = Llama()
