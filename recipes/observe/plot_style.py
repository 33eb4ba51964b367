"""Line styles that stay distinct for any number of lines (layers of a drift plot, jobs of a
sweep), and axis limits for fractions and errors. matplotlib only: the figures are built as
``matplotlib.figure.Figure`` objects (no pyplot state), so tests can inspect them."""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib
from matplotlib.colors import to_hex

MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")
FAILED_COLOR = "#d62728"
"""Red: jobs that did not complete. :func:`distinct_styles` never hands it out."""


@dataclass(frozen=True)
class LineStyle:
    color: str  # "#rrggbb"
    marker: str


def distinct_styles(n: int) -> list[LineStyle]:
    """``n`` styles, pairwise different colours (tab10 without its red for up to 9, tab20
    without its two reds for up to 18, else ``n`` samples of viridis) and markers cycling through
    :data:`MARKERS`, so neighbouring lines also differ in marker."""
    if n <= 9:
        colors = [to_hex(c) for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != 3]
    elif n <= 18:
        colors = [to_hex(c) for i, c in enumerate(matplotlib.colormaps["tab20"].colors) if i not in (6, 7)]
    else:
        cmap = matplotlib.colormaps["viridis"]
        colors = [to_hex(cmap(i / (n - 1))) for i in range(n)]
    return [LineStyle(colors[i], MARKERS[i % len(MARKERS)]) for i in range(n)]


def fraction_limits(values: list[float]) -> tuple[float, float]:
    """y limits for values that are fractions: the data's span plus a margin, clipped to [0, 1]
    (an all-1.0 series still gets a visible span, [0.995, 1])."""
    lo, hi = min(values), max(values)
    pad = max((hi - lo) * 0.05, 0.005)
    return max(0.0, lo - pad), min(1.0, hi + pad)
