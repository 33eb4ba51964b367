"""recipes.observe.plot_style: 12 drift layers shared a 10-colour cycle; overlap axes ran past 1."""

from __future__ import annotations

import pytest

from recipes.observe.plot_style import FAILED_COLOR, distinct_styles, fraction_limits


@pytest.mark.parametrize("n", [1, 4, 9, 10, 12, 18, 19, 78])
def test_styles_are_distinct_and_never_the_failed_red(n: int) -> None:
    styles = distinct_styles(n)
    assert len(styles) == n and len({s.color for s in styles}) == n
    assert FAILED_COLOR not in {s.color for s in styles}
    assert all(a.marker != b.marker for a, b in zip(styles, styles[1:]))  # neighbours differ twice


def test_fraction_limits_stay_in_0_1() -> None:
    assert fraction_limits([1.0, 1.0]) == (0.995, 1.0)  # a margin of 0.005 below a flat 1.0
    assert fraction_limits([0.0, 1.0]) == (0.0, 1.0)  # margin 0.05 clipped on both sides
    assert fraction_limits([0.5, 0.7]) == pytest.approx((0.49, 0.71))  # 5% of the span 0.2
