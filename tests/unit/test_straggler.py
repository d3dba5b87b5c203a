"""Straggler detection: the rule (median of peers, threshold, window) with an injected clock, the
work meter's hooks, the store exchange of one check with in-memory stores, live settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from resilient.config import load_config
from resilient.contract import mark_replace, replace_path, take_replace
from resilient.detectors.straggler_watch import (
    LiveSettings,
    Place,
    StragglerRule,
    StragglerWatch,
    parse_figures,
)
from resilient.detectors.stragglers import StragglerConfig, WorkMeter, local_module
from resilient.events import Event


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def figs(*work: float) -> dict[int, tuple[float, str]]:
    return {r: (w, "h") for r, w in enumerate(work)}


def test_a_rank_slow_for_the_window_is_reported_once() -> None:
    clock = Clock()
    rule = StragglerRule(clock)
    for t in (0.0, 2.0, 4.0):
        clock.t = t
        assert rule.judge(figs(1.0, 2.0, 1.1), range(3), 1.3, 6.0) == []
    clock.t = 6.0
    (s,) = rule.judge(figs(1.0, 2.0, 1.1), range(3), 1.3, 6.0)
    assert (s.rank, s.for_s) == (1, 6.0)
    assert abs(s.slowdown - 2.0 / 1.05) < 1e-9  # against the median of its peers
    clock.t = 8.0
    assert rule.judge(figs(1.0, 2.0, 1.1), range(3), 1.3, 6.0) == []  # once per episode


def test_one_fast_check_does_not_restart_the_window_but_a_fast_window_clears() -> None:
    # a CPU quota throttles in periods: one second of a slow rank's work may look normal
    clock = Clock()
    rule = StragglerRule(clock)
    for t, w in ((0.0, 3.0), (2.0, 1.0), (4.0, 3.0)):  # window mean 2.33 >= 1.3 x 1.0
        clock.t = t
        assert rule.judge(figs(1.0, w, 1.0), range(3), 1.3, 6.0) == []
    clock.t = 6.0
    (s,) = rule.judge(figs(1.0, 3.0, 1.0), range(3), 1.3, 6.0)
    assert s.rank == 1 and abs(s.slowdown - 2.5) < 1e-9 and s.for_s == 6.0
    for t in (8.0, 10.0, 12.0, 14.0):  # back to normal: the window's mean falls under the threshold
        clock.t = t
        assert rule.judge(figs(1.0, 1.0, 1.0), range(3), 1.3, 6.0) == []
    assert 1 not in rule.reported
    found = []
    for t in (16.0, 18.0, 20.0, 22.0):  # a new episode is reported again, once
        clock.t = t
        found += rule.judge(figs(1.0, 3.0, 1.0), range(3), 1.3, 6.0)
    assert [s.rank for s in found] == [1]


def test_forget_judges_a_successor_afresh() -> None:
    clock = Clock()
    rule = StragglerRule(clock)
    for t in (0.0, 2.0, 4.0, 6.0):
        clock.t = t
        rule.judge(figs(1.0, 3.0, 1.0), range(3), 1.3, 6.0)
    rule.forget(1)
    clock.t = 8.0  # the successor: slow too, but it has not been watched for a window yet
    assert rule.judge(figs(1.0, 3.0, 1.0), range(3), 1.3, 6.0) == []
    clock.t = 14.0
    assert [s.rank for s in rule.judge(figs(1.0, 3.0, 1.0), range(3), 1.3, 6.0)] == [1]


def test_a_missing_figure_neither_clears_nor_reports() -> None:
    clock = Clock()
    rule = StragglerRule(clock)
    rule.judge(figs(1.0, 3.0), range(2), 1.3, 4.0)
    clock.t = 5.0
    assert rule.judge({0: (1.0, "h")}, range(2), 1.3, 4.0) == []
    clock.t = 6.0
    assert [s.rank for s in rule.judge(figs(1.0, 3.0), range(2), 1.3, 4.0)] == [1]


def test_two_ranks_and_only_the_judged_ones() -> None:
    rule = StragglerRule(Clock())
    assert [s.rank for s in rule.judge(figs(1.0, 2.0), range(2), 1.3, 0.0)] == [1]  # 2× its one peer
    assert rule.judge(figs(1.0, 1.0, 5.0), range(2), 1.3, 0.0) == []  # rank 2 is another node's
    assert rule.judge({0: (1.0, "h")}, range(1), 1.3, 0.0) == []  # no peer: no verdict


def test_the_meter_times_forward_backward_and_optimizer_step_not_the_rest() -> None:
    t = [0.0]
    meter = WorkMeter(clock=lambda: t[0])

    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t[0] += 0.25  # the forward "takes" 0.25 s
            out = self.lin(x)
            out.register_hook(lambda g: t.__setitem__(0, t[0] + 1.0))  # its backward 1 s, before the grads
            return out

    model = Slow()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meter.track(model)
    meter.track(opt)
    meter.track(model)  # tracked twice: hooked once

    def slow_step(o: Any, args: Any, kwargs: Any) -> None:
        t[0] += 0.5  # (registered after the meter's: inside the timed step)

    opt.register_step_pre_hook(slow_step)
    assert meter.take() is None
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        t[0] += 5.0  # waiting for peers (DDP's all-reduce after the last gradient), the loader: not counted
        opt.step()
        meter.step_done()
    assert meter.take() == 0.25 + 1.0 + 0.5
    meter.clear()
    model(torch.ones(1, 2))
    meter.step_done()
    assert meter.take() == 0.0


def test_local_module() -> None:
    m = nn.Linear(1, 1)
    assert local_module(m) is m
    assert local_module(object()) is None


def test_parse_figures_skips_torn_lines() -> None:
    assert parse_figures("0 0.5 a\n1 x b\n2 0.7\n3 1e-3 c\n") == {0: (0.5, "a"), 3: (0.001, "c")}


def _watch(rank: int, local: int, size: int, store: dist.Store, meter: WorkMeter, out: list[Any],
           **kw: Any) -> StragglerWatch:  # fmt: skip
    cfg = StragglerConfig(check_s=1.0, threshold=1.3, window_s=0.0, **kw.pop("cfg", {}))
    return StragglerWatch(cfg, Place(rank, local, size, "ns"), meter, store,
                          lambda ev, **f: out.append((ev, f)), **kw)  # fmt: skip


class FixedMeter(WorkMeter):
    def __init__(self, work: float | None) -> None:
        super().__init__()
        self.work = work

    def take(self) -> float | None:
        return self.work


class Counting(dist.HashStore):
    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def append(self, *a: Any) -> None:
        self.requests += 1
        super().append(*a)

    def compare_set(self, *a: Any) -> bytes:
        self.requests += 1
        return super().compare_set(*a)

    def delete_key(self, *a: Any) -> bool:
        self.requests += 1
        return super().delete_key(*a)


def test_flat_exchange_judge_is_local_rank_zero() -> None:
    store, out = Counting(), []
    ws = [_watch(r, r, 3, store, FixedMeter(2.0 if r == 2 else 1.0), out) for r in range(3)]
    for k in (10, 11):
        for w in ws:
            w.tick(k)
    ev, f = out[0]
    assert (
        ev is Event.STRAGGLER_DETECTED and f["rank"] == 2 and f["action"] == "report" and f["slowdown"] == 2.0
    )
    assert len(out) == 1


def test_linked_exchange_costs_two_job_requests_per_node() -> None:
    """Two nodes of two ranks: each rank posts on its node's store, each leader carries its node's
    block to the job's store and judges its node; the job's store sees O(1) per node and check."""
    job, out = Counting(), []
    nodes = [dist.HashStore(), dist.HashStore()]

    class Link:
        def __init__(self, store: dist.Store, leader: bool) -> None:
            self.store, self.leader = store, leader

    ws = []
    for r in range(4):
        ns, leader = nodes[r // 2], r % 2 == 0
        w = _watch(r, r % 2, 2, job, FixedMeter(3.0 if r == 3 else 1.0), out,
                   node=lambda ns=ns, leader=leader: Link(ns, leader))  # fmt: skip
        w._node_store = ns  # (the thread's own connection: here the same in-memory store)
        ws.append(w)
    for k in range(10, 14):
        before = job.requests
        for w in ws:
            w.tick(k)
        assert job.requests - before <= 2 * 2 + 1  # an append and a read per node (+ rank 0's delete)
    assert [f["rank"] for _, f in out] == [3]
    assert all(f["judged_by"] == 2 for _, f in out)


def test_replace_marks_the_straggler_for_its_agent(tmp_path: Path) -> None:
    store, out = dist.HashStore(), []
    marks: list[tuple[int, dict[str, Any]]] = []

    def mark(local_rank: int, detail: dict[str, Any]) -> bool:
        marks.append((local_rank, detail))
        return mark_replace(tmp_path, local_rank, detail)

    ws = [_watch(r, r, 2, store, FixedMeter(1.0 + r), out, mark=mark, cfg={"action": "replace"})
          for r in range(2)]  # fmt: skip
    for k in (1, 2):
        for w in ws:
            w.tick(k)
    assert [m[0] for m in marks] == [1] and out[0][1]["action"] == "replace"
    assert take_replace(tmp_path, 1) == marks[0][1]
    assert not replace_path(tmp_path, 1).exists()
    # without a launcher to replace it, it is reported only
    out.clear()
    ws = [_watch(r, r, 2, dist.HashStore(), FixedMeter(1.0 + r), out, cfg={"action": "replace"})
          for r in range(2)]  # fmt: skip
    ws[1].store = ws[0].store
    for k in (1, 2):
        for w in ws:
            w.tick(k)
    assert out[0][1]["action"] == "report"


def test_live_settings(tmp_path: Path) -> None:
    path = tmp_path / "straggler.yaml"
    live = LiveSettings(StragglerConfig(), path)
    assert live.current().threshold == 1.3
    path.write_text("threshold: 2.0\naction: replace\n")
    cur = live.current()
    assert (cur.threshold, cur.action, cur.window_s) == (2.0, "replace", 30.0)
    path.write_text("check_s: 1\n")  # not live: ignored, the previous settings stay
    import os

    os.utime(path, (1, 1))
    assert live.current().threshold == 2.0
    path.unlink()
    assert live.current().threshold == 1.3


def test_config_defaults() -> None:
    cfg = load_config().straggler
    assert (cfg.enabled, cfg.action, cfg.threshold) == (True, "report", 1.3)
