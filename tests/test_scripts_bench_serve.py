"""scripts/bench-serve's statistics: the proxy's added latency is taken per pair, never as a
difference of two percentiles."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "lib" / "bench_serve.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


bench = load_bench()


def test_added_latency_is_the_median_of_per_pair_differences_not_a_difference_of_medians() -> None:
    # Direct times drift upward, each proxied request 1 ms slower than its pair. Percentiles of the
    # two runs apart would subtract unrelated requests; per pair, the added latency is 1 ms exactly.
    direct = [0.100, 0.200, 0.300, 0.400, 0.500]
    proxied = [0.101, 0.201, 0.301, 0.401, 0.501]
    stats = bench.paired_latency(direct, proxied)
    assert stats.pairs == 5
    assert stats.added_median == pytest.approx(0.001)
    assert stats.added_p90 == pytest.approx(0.001)
    assert stats.added_p99 == pytest.approx(0.001)
    assert stats.direct_median == pytest.approx(0.300)
    assert stats.proxy_median == pytest.approx(0.301)


def test_a_slow_direct_outlier_does_not_make_the_added_latency_negative() -> None:
    # The run that printed "added p99 -95.82 ms": one slow direct request (a hiccup of the machine)
    # drags the direct p99 above the proxy's. Paired, only that one pair's difference is negative.
    direct = [0.120] * 99 + [0.270]
    proxied = [0.1205] * 100
    stats = bench.paired_latency(direct, proxied)
    assert bench.percentile(proxied, 99) - bench.percentile(direct, 99) < 0  # what the old report showed
    assert stats.added_median == pytest.approx(0.0005)
    assert stats.added_p90 == pytest.approx(0.0005)
    assert stats.ratio_median == pytest.approx(0.1205 / 0.120)


def test_ratios_are_per_pair() -> None:
    stats = bench.paired_latency([0.1, 0.2, 0.4], [0.2, 0.2, 0.2])
    assert stats.ratio_median == pytest.approx(1.0)
    assert stats.ratio_p90 == pytest.approx(1.8)  # 80% of the way from 1.0 to 2.0
    assert stats.added_median == pytest.approx(0.0)


def test_pairs_must_match_and_be_positive() -> None:
    with pytest.raises(ValueError, match="do not pair"):
        bench.paired_latency([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="no pairs"):
        bench.paired_latency([], [])
    with pytest.raises(ValueError, match="not positive"):
        bench.paired_latency([0.0], [0.1])


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert bench.percentile(values, 0) == 1.0
    assert bench.percentile(values, 100) == 4.0
    assert bench.percentile(values, 50) == pytest.approx(2.5)
    assert bench.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        bench.percentile([], 50)
    with pytest.raises(ValueError):
        bench.percentile(values, 101)


def test_the_two_ways_strictly_alternate() -> None:
    # Never the same way twice in a row: the demo answers a repeated way slower the second time.
    ways = [bench.through_proxy(request) for request in range(10)]
    assert ways[0] is True
    assert all(ways[i] != ways[i + 1] for i in range(9))


def test_each_request_is_paired_with_its_neighbour_the_other_way() -> None:
    # proxy 10, direct 1, proxy 12, direct 3, proxy 14: the pairs are (10, 1), (12, 1), (12, 3), (14, 3),
    # the first of them going first through the proxy, the second direct, and so on.
    direct, proxied = bench.adjacent_pairs([10.0, 1.0, 12.0, 3.0, 14.0])
    assert direct == [1.0, 1.0, 3.0, 3.0]
    assert proxied == [10.0, 12.0, 12.0, 14.0]
    assert bench.adjacent_pairs([5.0]) == ([], [])


def test_a_drift_falls_on_both_sides_of_the_pairs() -> None:
    # Every request 1 ms slower than the one before, the proxy adding nothing: pairs where the proxy
    # went first see -1 ms, the others +1 ms, and the median of the differences is 0.
    drifting = [0.100 + 0.001 * request for request in range(101)]
    stats = bench.paired_latency(*bench.adjacent_pairs(drifting))
    assert stats.pairs == 100
    assert stats.added_median == pytest.approx(0.0)


def test_progress_is_about_ten_lines_ending_on_the_last_pair() -> None:
    assert bench.progress_marks(600) == {60, 120, 180, 240, 300, 360, 420, 480, 540, 600}
    assert max(bench.progress_marks(7)) == 7
    assert len(bench.progress_marks(7)) <= 7
    assert bench.progress_marks(1) == {1}
    assert bench.progress_marks(0) == set()
