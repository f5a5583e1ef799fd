"""One percentile definition for every bench and the demo: nearest rank, q in percent."""

from __future__ import annotations

import ast
import pathlib

import pytest

from shinken_sync.stats import percentile, percentiles

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 20) == 1.0  # ceil(5 * 0.2) = 1st
    assert percentile(values, 21) == 2.0
    assert percentile(values, 100) == 5.0
    assert percentile([1.0, 2.0], 50) == 1.0  # the lower middle value, never an average
    assert percentile(range(1, 101), 95) == 95  # no float noise pushes the rank up one
    assert percentile(range(1, 21), 95) == 19
    assert percentiles(values, (50, 100)) == {50: 3.0, 100: 5.0}


@pytest.mark.parametrize("q", [0, 0.0, -1, 100.5])
def test_out_of_range_q_is_refused(q):
    with pytest.raises(ValueError, match="percentage"):
        percentile([1.0], q)


def test_no_values_is_an_error_not_a_number():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_no_bench_or_demo_defines_its_own():
    """No other percentile/quantile function, and no statistics.quantiles, in bench/ or the demo."""
    files = [*ROOT.joinpath("bench").glob("*.py"), *ROOT.joinpath("shinken_sync", "demo").glob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") in ("percentile", "quantile"):
                pytest.fail(f"{path.name} defines {node.name}")
            if isinstance(node, ast.Attribute) and node.attr == "quantiles":
                pytest.fail(f"{path.name} calls statistics.quantiles (line {node.lineno})")
