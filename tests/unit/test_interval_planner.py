"""Checkpoint-interval planner: the formulas, the optimum, and the simulation that checks them."""

from __future__ import annotations

import math

import pytest

from resilient.cli import main
from resilient.state import interval_planner as planner


def test_young_and_daly_formulas():
    assert planner.young(30, 3600) == pytest.approx(math.sqrt(2 * 30 * 3600))
    x = 30 / (2 * 3600)
    expected = math.sqrt(2 * 30 * 3600) * (1 + math.sqrt(x) / 3 + x / 9) - 30
    assert planner.daly(30, 3600) == pytest.approx(expected)
    assert planner.daly(8000, 3600) == 3600  # delta >= 2M: checkpoint every MTBF


@pytest.mark.parametrize(("delta", "mtbf", "restart"), [(30, 11135, 300), (60, 28440, 600), (5, 600, 20)])
def test_daly_interval_is_near_the_goodput_optimum(delta, mtbf, restart):
    best = planner.goodput(planner.daly(delta, mtbf), delta, restart, mtbf)
    grid = [planner.daly(delta, mtbf) * f for f in (0.5, 0.7, 0.85, 1.15, 1.4, 2.0)]
    assert all(planner.goodput(t, delta, restart, mtbf) <= best + 1e-4 for t in grid)


@pytest.mark.parametrize(("delta", "mtbf", "restart"), [(30, 11135, 300), (60, 28440, 600), (5, 600, 20)])
def test_simulation_agrees_with_the_closed_form(delta, mtbf, restart):
    tau = planner.daly(delta, mtbf)
    sim = planner.simulate(tau, delta, restart, mtbf, segments=20_000, seed=1)
    assert sim.failures > 100  # the simulation really met failures
    assert sim.goodput == pytest.approx(planner.goodput(tau, delta, restart, mtbf), rel=0.02)


def test_without_failures_goodput_is_compute_over_compute_plus_writes():
    sim = planner.simulate(100, 10, 50, mtbf=1e12, segments=1000)
    assert sim.failures == 0
    assert sim.goodput == pytest.approx(100 / 110)


def test_mtbf_from_gpus_and_bad_input():
    assert planner.mtbf_from_gpus(1024, 7.9 * 1024) == pytest.approx(7.9 * 3600)
    with pytest.raises(ValueError, match="gpus"):
        planner.mtbf_from_gpus(0, 1.0)
    with pytest.raises(ValueError, match="interval"):
        planner.goodput(0, 1, 1, 100)


def test_plan_command_prints_both_intervals_and_checks_the_simulation(capsys):
    assert (
        main(["plan", "--mtbf-h", "7.9", "--write-s", "60", "--restart-s", "600", "--segments", "5000"]) == 0
    )
    out = capsys.readouterr().out
    assert "Young" in out and "Daly" in out and "Monte-Carlo" in out
    assert main(["plan", "--write-s", "1", "--restart-s", "1"]) == 2  # no MTBF given
