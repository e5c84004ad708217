"""The one bisection for the most work that fits (decode rows, scoring batch tokens), against a linear scan."""

from __future__ import annotations

import pytest

from app.engine.admission import most_that_fit


@pytest.mark.parametrize("low", [0, 1])
@pytest.mark.parametrize("high", [0, 1, 2, 7, 64])
@pytest.mark.parametrize("limit", [-1, 0, 1, 5, 64, 100])
def test_the_largest_n_that_fits_or_the_floor(low, high, limit):
    asked = []

    def fits(n):
        asked.append(n)
        return n <= limit

    expected = max([low] + [n for n in range(low, high + 1) if n <= limit])
    assert most_that_fit(low, high, fits) == expected
    assert all(low < n <= high for n in asked)  # the floor is never asked: the caller stands by it
    assert len(asked) <= max(1, high - low).bit_length()
