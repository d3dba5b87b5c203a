"""The store tail benchmark's own arithmetic: nearest-rank percentiles, slow requests by cause, the
verdict against issue 29's target and the printed table."""

from __future__ import annotations

import pytest

from benchmarks import store_tail


def test_percentiles_are_nearest_rank_and_count_the_slow() -> None:
    xs = [i / 10_000 for i in range(1, 10_001)]  # 0.1 ms .. 1 s, one of each
    t = store_tail.tail(list(reversed(xs)))
    assert t["n"] == 10_000
    got = [t["p50_ms"], t["p99_ms"], t["p999_ms"], t["p9999_ms"], t["max_ms"]]
    assert got == pytest.approx([500.0, 990.0, 999.0, 999.9, 1000.0])  # the 5,000th smallest, ...
    assert t["over_100ms"] == 9_000 and t["over_1s"] == 0  # (over: strictly)
    assert store_tail.tail([5.0])["p50_ms"] == 5000.0 and store_tail.tail([5.0])["over_1s"] == 1


def test_no_samples_is_no_percentile_not_zero() -> None:
    t = store_tail.tail([])
    assert t["n"] == 0 and t["p9999_ms"] is None and t["max_ms"] is None


def test_a_slow_request_is_a_stall_only_when_the_server_slept_through_it() -> None:
    # (t, server s on a core, s waiting for one): 0-1 s asleep (blocked: a stall); 1-2 s busy a
    # full core (queueing); 2-3 s runnable, waiting for a core the others took (queueing too)
    samples = [(0.0, 0.0, 0.0), (1.0, 0.1, 0.05), (2.0, 1.0, 0.1), (3.0, 1.1, 0.9)]
    slow = [(0.1, 0.8), (1.1, 0.5), (2.1, 0.5), (2.9, 0.5)]
    assert store_tail.classify(slow, samples) == {"stall": 1, "cpu": 2, "unsampled": 1}


def _cell(**kw: object) -> dict:
    r = store_tail.tail([0.001] * 10)
    cell = {"backend": "libuv", "names": "numeric", "clients": 256, "connected": 256, "requests": r,
            "connects": dict(r), "probe": dict(r), "server_cpu": 0.5, "server_wait": 0.1, "load_s": 1.0,
            "slow": {"stall": 0, "cpu": 0}}  # fmt: skip
    cell.update(kw)
    return cell


def test_verdict_names_every_miss_and_only_judges_numeric_cells_at_the_target_sizes() -> None:
    many = {**store_tail.tail([0.001] * 10), "n": 1_000_000}
    ok = _cell(requests=many, connects={**many, "n": 10_000})
    assert store_tail.verdict(ok) == "met"
    slow = {**many, "over_1s": 2, "p9999_ms": 80.0}
    v = store_tail.verdict(_cell(requests=slow, connects={**many, "n": 9_000}))
    assert "2 requests > 1 s" in v and "p99.99 80.0 ms > 50 ms" in v and "9,000 connects < 10,000" in v
    assert store_tail.verdict(_cell(names="lookups")) == ""
    assert store_tail.verdict(_cell(clients=2)) == ""


def test_table_has_a_row_per_cell_and_says_how_many_clients_connected() -> None:
    out = store_tail.table([_cell(), _cell(names="lookups", connected=200)]).splitlines()
    assert out[0].split()[:3] == ["backend", "names", "clients"]
    assert "200/256" in out[3] and "200/256" not in out[2]
    assert len({len(line) for line in out[:4]}) == 1  # the columns line up
