"""The FP8 formats the quantizers and their kernels share: e4m3 limits, the scale formats, the
training recipes and their tile shapes.

A contract, not an implementation: the torch reference (:mod:`kpool_layers.precision.fp8`) and
the Triton kernels (:mod:`kpool_layers.kernels`) both import it, so a kernel never imports the
module that routes to it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` magnitude."""

AMAX_EPS = 1e-4
"""Lower bound on ``amax`` before the scale is computed (all-zero groups get a finite scale)."""

BLOCK = 128
"""Tile width of the blockwise recipe and of the serving index path."""


class ScaleFormat(StrEnum):
    """How a group's dequantization scale is stored (``precision.scale_format``)."""

    ue8m0 = "ue8m0"
    """A power of two (an 8-bit exponent, as DeepGEMM and the serving engines keep it)."""
    amax = "amax"
    """``amax / 448`` in FP32."""


class Recipe(StrEnum):
    """FP8 training scaling recipe (``precision.recipe``)."""

    blockwise = "blockwise"
    """1x128 activation tiles, 128x128 weight blocks."""
    tensorwise = "tensorwise"
    """One scale per tensor."""
    rowwise = "rowwise"
    """One scale per row."""


Operand = Literal["activation", "weight"]

SCALE_FORMATS: tuple[str, ...] = tuple(f.value for f in ScaleFormat)
RECIPES: tuple[str, ...] = tuple(r.value for r in Recipe)
OPERANDS: tuple[str, ...] = ("activation", "weight")



def tile_shape(recipe: str, operand: str, rows: int, cols: int) -> tuple[int, int]:
    """(tile rows, tile cols) of one scale for a ``[rows, cols]`` matrix."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r} is not supported; allowed: {list(RECIPES)}")
    if operand not in OPERANDS:
        raise ValueError(f"operand={operand!r} is not supported; allowed: {list(OPERANDS)}")
    if recipe == "tensorwise":
        return max(rows, 1), max(cols, 1)
    if recipe == "rowwise":
        return 1, max(cols, 1)
    return (1, BLOCK) if operand == "activation" else (BLOCK, BLOCK)
