"""The one rule for numbers given as settings (budget, health thresholds, operator timeouts)."""

import math

import pytest

from airflow_stream_provider.settings_numbers import finite_number, rendered_seconds, whole_number


@pytest.mark.parametrize("value", [0, 1, -2, 0.5, 1e300])
def test_finite_numbers(value):
    assert finite_number(value)


@pytest.mark.parametrize("value", [True, False, math.nan, math.inf, -math.inf, "5", None, [1]])
def test_not_finite_numbers(value):
    assert not finite_number(value)


def test_whole_numbers_are_ints_but_not_bools():
    assert whole_number(3) and whole_number(-1)
    assert not whole_number(True) and not whole_number(3.0) and not whole_number("3")


@pytest.mark.parametrize(("value", "seconds"), [(30, 30.0), ("30", 30.0), (" 2.5 ", 2.5), ("0", 0.0), (-1, -1.0)])
def test_rendered_seconds_reads_numbers_and_their_text(value, seconds):
    assert rendered_seconds(value) == seconds


@pytest.mark.parametrize("value", [True, "5m", "nan", "inf", math.inf, None, {}])
def test_rendered_seconds_refuses_the_rest(value):
    assert rendered_seconds(value) is None
