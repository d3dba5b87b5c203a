"""Goodput accounting, the Prometheus exporter and the report/status commands, on event logs."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from resilient.cli import main as cli
from resilient.metrics import CAUSES, OTHER, account
from resilient.metrics.exporter import Exporter, LogTail, RunMetrics
from resilient.metrics.report import fault_blocks

T0 = 1_000_000.0


def ev(t: float, event: str, rank: int = 0, **kw: Any) -> dict[str, Any]:
    rec = {
        "ts": T0 + t,
        "event": event,
        "rank": rank,
        "pid": kw.pop("pid", 100 + rank),
        "generation": kw.pop("generation", 0),
        "step": kw.pop("step", None),
        "host": "h",
    }
    return {**rec, **kw}


def steps(rank: int, t0: float, first: int, last: int, dt: float, **kw: Any) -> list[dict[str, Any]]:
    return [ev(t0 + (s - first) * dt, "step_completed", rank, step=s, **kw) for s in range(first, last + 1)]


def in_process_run() -> list[dict[str, Any]]:
    """2 ranks: start-up 2 s, steps 0-19 at 0.1 s, an exception on rank 1 at step 20 (t=4.0),
    detected at once, restored to step 10, resumed at t=4.5, steps 10-39, finished."""
    out = [ev(0, "run_started", r, world_size=2, max_restarts=3, restart_window_s=3600.0) for r in (0, 1)]
    for r in (0, 1):
        out += steps(r, 2.0, 0, 19, 0.1)
        out.append(
            ev(
                4.0,
                "fault_detected",
                r,
                step=20,
                kind="exception",
                origin_rank=1,
                origin_step=20,
                origin_ts=T0 + 4.0,
                origin_latency_s=0.0,
                signature="exception: ValueError",
            )
        )
        out.append(ev(4.4, "state_restored", r, generation=1, step=10, steps_rerun=10))
        out.append(ev(4.5, "step_resumed", r, generation=1, step=10))
        out += steps(r, 4.5, 10, 39, 0.1, generation=1)
        out.append(ev(7.4, "run_finished", r, generation=1, step=39))
    out.append(
        ev(4.0, "fault_report", 1, step=20, kind="exception", traceback="Traceback ...\nValueError: boom")
    )
    return out


def test_every_second_has_one_cause_and_they_add_up_to_the_wall_time():
    acc = account(in_process_run())
    assert acc.wall_s == pytest.approx(7.4)
    assert sum(acc.seconds.values()) == pytest.approx(acc.wall_s)
    assert acc.seconds[OTHER] == pytest.approx(0.0, abs=1e-9)
    assert acc.seconds["startup"] == pytest.approx(2.0)
    assert acc.seconds["recovery"] == pytest.approx(0.5)
    assert acc.seconds["productive"] == pytest.approx(1.9 + 2.0)  # steps 1-19, then 20-39
    assert acc.seconds["rerun"] == pytest.approx(0.1 + 0.9)  # the interrupted step 20, then 11-19 again
    assert acc.goodput == pytest.approx(3.9 / 7.4)
    (inc,) = acc.incidents
    assert (inc.kind, inc.rank, inc.step, inc.mode, inc.steps_rerun) == ("exception", 1, 20, "in_process", 10)
    assert inc.recover_s == pytest.approx(0.5)


def test_the_job_starts_when_its_launcher_did():
    # the launcher imported and met its peers for 1.5 s before it started the workers at t=0
    evs = [ev(0, "workers_started", -1, launched=T0 - 1.5), *in_process_run()]
    acc = account(evs)
    assert acc.wall_s == pytest.approx(7.4 + 1.5)
    assert acc.seconds["startup"] == pytest.approx(2.0 + 1.5)
    assert acc.goodput == pytest.approx(3.9 / 8.9)


def test_a_hang_is_detection_time_from_its_last_progress():
    evs = [ev(0, "run_started", 0, world_size=1), *steps(0, 1.0, 0, 9, 0.1)]
    # the watchdog posts the hang 2 s after the last progress (t=1.9 -> 3.9)
    evs.append(
        ev(
            3.9,
            "fault_detected",
            0,
            step=10,
            kind="hang",
            origin_rank=0,
            origin_step=10,
            origin_ts=T0 + 3.9,
            origin_latency_s=2.0,
            signature="hang: no step progress",
        )
    )
    evs += [ev(4.2, "step_resumed", 0, generation=1, step=5), *steps(0, 4.3, 6, 12, 0.1, generation=1)]
    acc = account(evs)
    assert acc.incidents[0].detect_s == pytest.approx(2.0)
    assert acc.seconds["detection"] == pytest.approx(2.0)
    assert sum(acc.seconds.values()) == pytest.approx(acc.wall_s)


def test_sparse_progress_before_a_dead_worker_is_productive_up_to_the_restored_step():
    # progress records every 50 steps (no step records); rank 1 dies at t=8 in step 60; both
    # resume live at step 60 (nothing re-run): steps 50-59 after the last record were productive
    evs = [ev(0, "workers_started", -1, restarts_left=3)]
    for r in (0, 1):
        evs += [ev(0.5, "run_started", r, world_size=2), ev(1.0, "progress", r, step=0)]
        evs.append(ev(6.0, "progress", r, step=50))
    evs.append(ev(8.0, "worker_died", -1, pid=7, global_rank=1, cause="killed by SIGKILL (not an OOM kill)"))
    evs.append(ev(8.0, "rank_replaced", -1, global_rank=1, restarts_left=2))
    for r in (0, 1):
        evs.append(ev(8.2, "state_restored", r, generation=1, step=60, steps_rerun=0, source="live"))
        evs.append(ev(8.3, "step_resumed", r, generation=1, step=60))
        evs.append(ev(12.3, "run_finished", r, generation=1, step=99))
    acc = account(evs)
    assert acc.seconds["rerun"] == pytest.approx(0.0)
    assert acc.seconds["productive"] == pytest.approx(7.0 + 4.0)  # 1.0-8.0, then 8.3-12.3


def test_a_dead_worker_is_the_cause_not_the_broken_collective_its_peer_saw():
    evs = [ev(0, "workers_started", -1, restarts_left=3)]
    evs += [ev(0.5, "run_started", r, world_size=2) for r in (0, 1)]
    for r in (0, 1):
        evs += steps(r, 1.0, 0, 9, 0.1)
    # rank 0's collective fails a moment before the agent reports rank 1's death
    evs.append(
        ev(
            2.0,
            "fault_detected",
            0,
            step=10,
            kind="collective",
            origin_rank=0,
            origin_step=10,
            origin_ts=T0 + 2.0,
            signature="collective: connection reset",
        )
    )
    evs.append(ev(2.05, "worker_died", -1, pid=7, global_rank=1, cause="killed by SIGKILL (not an OOM kill)"))
    evs.append(ev(2.06, "rank_replaced", -1, global_rank=1, last_step=9, restarts_left=2))
    evs += steps(0, 2.5, 5, 12, 0.1, generation=1)
    evs += steps(1, 2.5, 5, 12, 0.1, generation=1, pid=555)
    acc = account(evs)
    (inc,) = acc.incidents
    assert (inc.kind, inc.rank, inc.mode, inc.noticed_by) == ("killed", 1, "replacement", "rank 0")
    assert inc.end == pytest.approx(T0 + 2.5)
    assert acc.seconds["replacement"] == pytest.approx(0.5)


def test_without_step_records_progress_records_split_a_stretch_by_counts():
    evs = [ev(0, "run_started", 0, world_size=1), ev(1.0, "progress", 0, step=0, first=True)]
    evs.append(ev(11.0, "progress", 0, step=100))
    evs.append(
        ev(
            12.0,
            "fault_detected",
            0,
            step=110,
            kind="exception",
            origin_rank=0,
            origin_step=110,
            origin_ts=T0 + 12.0,
            signature="exception: X",
        )
    )
    evs.append(ev(12.5, "state_restored", 0, generation=1, step=60, steps_rerun=50))
    evs.append(ev(13.0, "step_resumed", 0, generation=1, step=60))
    evs.append(ev(23.0, "run_finished", 0, generation=1, step=160))
    acc = account(evs)
    assert not acc.exact_steps
    assert sum(acc.seconds.values()) == pytest.approx(acc.wall_s)
    assert acc.seconds[OTHER] == pytest.approx(0.0, abs=1e-9)
    # 13 -> 23 s: steps 61-160, of which 61-109 (49) were done before the fault
    assert acc.seconds["rerun"] == pytest.approx(10 * 49 / 100, rel=1e-6)
    assert acc.steps == 161


def test_checkpoint_blocking_is_taken_out_of_the_steps():
    evs = [ev(0, "run_started", 0, world_size=1), *steps(0, 1.0, 0, 10, 0.1)]
    evs.append(ev(1.55, "checkpoint_saved", 0, step=5, block_s=0.05))
    acc = account(evs)
    assert acc.seconds["checkpoint"] == pytest.approx(0.05)
    assert acc.seconds["productive"] == pytest.approx(1.0 - 0.05)


def test_an_unrecovered_fault_stays_open_and_the_run_is_failed():
    evs = [ev(0, "run_started", 0, world_size=1), *steps(0, 1.0, 0, 3, 0.1)]
    evs.append(
        ev(
            1.5,
            "fault_detected",
            0,
            step=4,
            kind="exception",
            origin_rank=0,
            origin_step=4,
            origin_ts=T0 + 1.5,
            signature="exception: X",
        )
    )
    evs.append(ev(1.6, "run_failed", 0, step=4, error="FaultRepeats"))
    (inc,) = account(evs).incidents
    assert inc.end is None and inc.mode == "failed"


def test_fault_blocks_name_the_rank_and_show_its_traceback():
    (block,) = fault_blocks(in_process_run())
    assert "exception on rank 1 on h" in block and "step 20" in block
    assert "noticed by rank" in block and "in-process in 0.500 s; 10 steps re-run" in block
    assert "ValueError: boom" in block


def write_log(tmp_path: Path, events: list[dict[str, Any]]) -> Path:
    run = tmp_path / "runs" / "abc123"
    run.mkdir(parents=True)
    log = run / "events.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    return log


def test_the_log_tail_reads_only_whole_new_lines(tmp_path: Path):
    log = tmp_path / "events.jsonl"
    log.write_text('{"a": 1}\n{"b": ')
    tail = LogTail(log)
    assert tail.poll() == [{"a": 1}]
    with open(log, "a") as f:
        f.write("2}\nnot json\n[1]\n")
    assert tail.poll() == [{"b": 2}]  # a garbled line and a non-record are skipped


def scrape(port: int) -> dict[str, list[Any]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_the_endpoint_serves_what_the_log_says(tmp_path: Path):
    log = write_log(tmp_path, in_process_run())
    m = RunMetrics(log, run_id="abc123", refresh_s=0.0)
    m.poll(force=True)
    ex = Exporter(m, 0, "127.0.0.1", poll_s=0.05)
    assert ex.start()
    try:
        got = scrape(ex.port)
    finally:
        ex.close()
    faults = got["resilient_faults_total"]
    assert [(s.labels["kind"], s.labels["rank"], s.value) for s in faults] == [("exception", "1", 1.0)]
    restarts = {s.labels["mode"]: s.value for s in got["resilient_restarts_total"]}
    assert restarts == {"in_process": 1.0, "replacement": 0.0, "relaunch": 0.0}
    acc = account(in_process_run())
    by_cause = {s.labels["cause"]: s.value for s in got["resilient_time_seconds"]}
    assert set(by_cause) == {*CAUSES, OTHER}
    assert by_cause["productive"] == pytest.approx(acc.seconds["productive"])
    assert got["resilient_goodput_ratio"][0].value == pytest.approx(acc.goodput)
    assert got["resilient_steps_rerun_total"][0].value == 10
    state = {s.labels["state"]: s.value for s in got["resilient_run_state"]}
    assert state["finished"] == 1.0
    assert got["resilient_last_fault_info"][0].labels["kind"] == "exception"
    budget = {s.labels["scope"]: s.value for s in got["resilient_restart_budget_remaining"]}
    assert budget == {"in_process": 2.0}


def test_the_endpoint_serves_each_phase_of_the_recoveries(tmp_path: Path):
    from prometheus_client import CollectorRegistry, generate_latest

    def served(events: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
        m = RunMetrics(write_log(tmp_path / str(len(events)), events), run_id="abc123", refresh_s=0.0)
        m.poll(force=True)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(m)
        out: dict[str, dict[str, float]] = {}
        for fam in text_string_to_metric_families(generate_latest(registry).decode()):
            for s in fam.samples:
                if s.name.startswith("resilient_recovery_phase_seconds"):
                    key = s.name.removeprefix("resilient_recovery_phase_seconds") + s.labels.get("le", "")
                    out.setdefault(s.labels["phase"], {})[key] = s.value
        return out

    got = served(phased_run())
    ms = {"detect": 10, "leave": 30, "health": 110, "agree": 40, "free": 60, "rebuild": 40, "restore": 40,
          "reenter": 70, "rerun": 100}  # fmt: skip
    assert list(got) == list(ms)  # every phase, in order
    for phase, v in ms.items():
        assert got[phase]["_count"] == 1.0
        assert got[phase]["_sum"] == pytest.approx(v / 1e3)
    assert (got["health"]["_bucket0.1"], got["health"]["_bucket0.25"]) == (0.0, 1.0)  # 0.110 s
    assert (got["detect"]["_bucket0.005"], got["detect"]["_bucket0.025"]) == (0.0, 1.0)  # 0.010 s
    assert got["rerun"]["_bucket+Inf"] == 1.0
    # a log without the phases' records: every phase served, none observed
    got = served(in_process_run())
    assert len(got) == 9 and {v["_count"] for v in got.values()} == {0.0}


def test_a_taken_port_is_one_warning_and_no_endpoint(tmp_path: Path, caplog_loguru: list[str]):
    log = write_log(tmp_path, in_process_run())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        ex = Exporter(RunMetrics(log, run_id="abc123"), port, "127.0.0.1")
        assert ex.start() is False
        assert ex.start() is False
    warnings = [m for m in caplog_loguru if "cannot serve on 127.0.0.1:" in m]
    assert len(warnings) == 1 and "training is not affected" in warnings[0]


def test_report_prints_the_table_and_writes_the_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    log = write_log(tmp_path, in_process_run())
    assert cli(["report", str(tmp_path / "runs"), "--json", "--png", str(tmp_path / "g.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["goodput"] == pytest.approx(account(in_process_run()).goodput)
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert cli(["report", str(log.parent)]) == 0
    assert (log.parent / "goodput.png").exists()


def test_report_to_an_unwritable_path_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    write_log(tmp_path, in_process_run())
    bad = tmp_path / "no" / "such" / "dir" / "g.png"
    assert cli(["report", str(tmp_path / "runs"), "--png", str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"cannot write {bad}" in err and "Traceback" not in err


def test_report_without_matplotlib_fails_only_where_a_png_was_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    log = write_log(tmp_path, in_process_run())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (an import of it raises ImportError)
    assert cli(["report", str(log.parent)]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "pip install 'resilient[metrics]'" in out
    assert not (log.parent / "goodput.png").exists()
    assert cli(["report", str(log.parent), "--json"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["goodput"] is not None and "resilient[metrics]" in got.err
    assert cli(["report", str(log.parent), "--png", str(tmp_path / "g.png")]) == 1
    assert "matplotlib is not installed" in capsys.readouterr().err


def test_report_and_status_name_a_missing_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    for cmd in ("report", "status"):
        assert cli([cmd, str(tmp_path / "nothing")]) == 2
        assert "no event log at" in capsys.readouterr().err


def test_status_shows_every_rank_and_the_goodput(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    write_log(tmp_path, in_process_run())
    assert cli(["status", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "state finished" in out and "faults 1" in out and "goodput 52.7%" in out
    assert "│ 0    │ h" in out and "│ 1    │ h" in out


def test_status_and_metrics_say_which_standbys_wait(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    evs = in_process_run()
    evs += [
        ev(1.0, "standby_ready", -1, standby_pid=7, warmth="parked"),
        ev(1.1, "standby_fallback", -1, standby_pid=8, reason="the script's top level read RANK"),
        ev(1.2, "standby_ready", -1, standby_pid=8, warmth="imported"),
        ev(2.0, "rank_replaced", -1, new_pid=7, standby=True, restarts_left=2),  # the parked one used
    ]
    log = write_log(tmp_path, evs)
    assert cli(["status", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "standbys waiting: 1 (1 imported); 1 could not park in the script" in out
    m = RunMetrics(log, run_id="abc123", refresh_s=0.0)
    m.poll(force=True)
    ex = Exporter(m, 0, "127.0.0.1")
    assert ex.start()
    try:
        got = scrape(ex.port)
    finally:
        ex.close()
    ready = {s.labels["warmth"]: s.value for s in got["resilient_standbys_ready"]}
    assert ready == {"parked": 0.0, "imported": 1.0}
    assert [s.value for s in got["resilient_standby_fallbacks_total"]] == [1.0]


def test_events_faults_prints_the_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    log = write_log(tmp_path, in_process_run())
    assert cli(["events", str(log.parent), "--faults"]) == 0
    out = capsys.readouterr().out
    assert "fault 1: exception on rank 1" in out
    assert "phases" not in out  # (a log without restore_agreed: no phases to tell)


# the recovery of in_process_run, every phase recorded (docs/recovery.md#phases): per rank, when it
# noticed (its fault_detected's ts), left, checked, agreed, prepared, freed, rebuilt, entered, restored
PHASED = {
    0: (4.01, 4.02, 4.03, 4.05, 4.18, 4.20, 4.25, 4.30, 4.36, 4.39),
    1: (4.00, 4.00, 4.04, 4.15, 4.19, 4.21, 4.27, 4.31, 4.38, 4.40),  # rank 1: a slow health check
}
PHASES_LINE = (
    "  phases     detect 10.0, leave 30.0, health 110.0, agree 40.0, free 60.0, rebuild 40.0, "
    "restore 40.0, reenter 70.0, rerun 100.0 ms (= 500.0 ms); ended last by rank 1 (rank 0: detect)"
)


def phased_run() -> list[dict[str, Any]]:
    out = []
    for e in in_process_run():
        r = e["rank"]
        if e["event"] in ("fault_detected", "state_restored") and r in PHASED:
            noticed, detected, *_, entered, restored = PHASED[r]
            if e["event"] == "fault_detected":
                e = {**e, "ts": T0 + detected, "noticed_ts": T0 + noticed}
            else:
                e = {**e, "ts": T0 + restored, "load_s": round(restored - entered, 9)}
        out.append(e)
    for r, (_n, _d, left, checked, agreed, prepared, freed, rebuilt, _e, _r) in PHASED.items():
        out += [
            ev(left, "group_aborted", r, step=20),
            ev(checked, "health_checked", r, step=20, ok=True),
            ev(prepared, "restore_agreed", r, step=10, fault_step=20, barrier_s=0.01,
               prepare_s=round(prepared - agreed, 9)),
            ev(rebuilt, "group_rebuilt", r, generation=1, step=10, build_s=round(rebuilt - freed, 9)),
        ]  # fmt: skip
    return sorted(out, key=lambda e: e["ts"])


def test_a_recovery_in_process_shows_its_phases(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (block,) = fault_blocks(phased_run())
    lines = block.splitlines()
    assert lines[2].startswith("  recovered  in-process in 0.500 s")
    assert lines[3] == PHASES_LINE  # the phases add up to the fault -> every rank's first step
    log = write_log(tmp_path, phased_run())
    assert cli(["events", str(log.parent), "--faults"]) == 0
    assert PHASES_LINE in capsys.readouterr().out.splitlines()
    # one rank last in every phase: named once
    evs = [
        {**e, "noticed_ts": T0 + 4.0, "ts": T0 + 4.0} if e["event"] == "fault_detected" else e
        for e in phased_run()
    ]
    (block,) = fault_blocks(evs)
    assert block.splitlines()[3].endswith("(= 500.0 ms); ended last by rank 1")
    # a fault recovered by relaunching the group: no phases, even with a rank's restore_agreed
    evs = [*phased_run(), ev(4.05, "relaunched", -1)]
    assert "phases" not in fault_blocks(evs)[0]


ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "resilient-dashboard.json"
ALERTS = ROOT / "configs" / "prometheus" / "alerts.yml"


def served_names(tmp_path: Path) -> set[str]:
    """Every sample name the endpoint serves for a run with a fault, a checkpoint, heartbeats and
    a straggler."""
    evs = in_process_run()
    evs += [
        ev(3.2, "straggler_detected", 1, slowdown=2.1, action="report"),
        ev(3.0, "checkpoint_saved", 0, step=10, block_s=0.01),
        ev(3.5, "checkpoint_durable", 0, step=10, write_s=0.4, nbytes=1000),
        ev(3.0, "progress", 0, step=10, step_s=0.1, runtime_ms_per_step=0.2),
    ]
    hb = tmp_path / "hb"
    hb.mkdir()
    from resilient.contract import Heartbeat

    beat = Heartbeat(hb / "rank00000.hb", interval=60)
    beat.beat(5)
    m = RunMetrics(write_log(tmp_path, evs), run_id="abc123", heartbeat_dir=hb, refresh_s=0.0)
    m.poll(force=True)
    ex = Exporter(m, 0, "127.0.0.1")
    assert ex.start()
    try:
        names = set(scrape(ex.port))
    finally:
        ex.close()
        beat.close()
    assert "resilient_heartbeat_age_seconds" in names
    return names


def test_the_dashboard_and_the_alert_rules_ask_only_for_served_metrics(tmp_path: Path):
    import re

    import yaml

    served = served_names(tmp_path)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dash["annotations"]["list"]]
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    exprs += [r["expr"] for r in rules]
    asked = {n for e in exprs for n in re.findall(r"\bresilient_[a-z_]+", e)}
    assert asked and asked <= served, f"not served: {sorted(asked - served)}"
    assert {r["alert"] for r in rules} >= {
        "ResilientJobStalled",
        "ResilientRestartBudgetLow",
        "ResilientGoodputBelowSLO",
    }


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed"
)
def test_promtool_accepts_the_alert_rules():
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_status_follow_ends_with_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    write_log(tmp_path, in_process_run())
    assert cli(["status", str(tmp_path / "runs"), "--follow", "--interval", "0.01"]) == 0
    assert "state finished" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["status", "x", "--interval", "0"], "argument --interval: must be > 0: 0"),
        (["status", "x", "--interval", "soon"], "argument --interval: not a number: 'soon'"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(SystemExit) as e:
        cli(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("value", ["70000", "http", "-1"])
def test_a_bad_metrics_port_is_refused_by_the_launcher(value: str, capsys: pytest.CaptureFixture[str]):
    from resilient.launcher.cli import parser

    with pytest.raises(SystemExit) as e:
        parser().parse_args(["--metrics-port", value, "train.py"])
    err = capsys.readouterr().err
    assert (
        e.value.code == 2 and "argument --metrics-port: not a port number" in err and "Traceback" not in err
    )


def test_a_step_the_guard_rejected_is_a_roll_back_not_a_crash():
    evs = [
        {**e, "kind": "nonfinite", "signature": "nonfinite: NonFiniteStep"}
        if e["event"] == "fault_detected"
        else e
        for e in in_process_run()
        if e["event"] != "fault_report"
    ]
    acc = account(evs)
    assert sum(acc.seconds.values()) == pytest.approx(acc.wall_s)
    assert acc.seconds["recovery"] == acc.seconds["rerun"] == 0.0
    assert acc.seconds["rollback"] == pytest.approx(0.5 + 0.1 + 0.9)  # the recovery, step 20, then 11-19
    assert acc.seconds["productive"] == pytest.approx(1.9 + 2.0)


def test_fault_blocks_show_the_verdicts_of_faults_that_raise_nothing():
    evs = [
        {**e, "kind": "sdc", "signature": "sdc: SilentCorruption: replicas differ"}
        if e["event"] == "fault_detected"
        else e
        for e in in_process_run()
    ]
    for r in (0, 1):  # both ranks name rank 1: shown once
        evs.append(ev(4.2, "sdc_detected", r, step=19, ranks=[1], how="majority"))
    evs.append(ev(6.0, "straggler_detected", 1, slowdown=2.1, for_s=30.0, action="report"))
    block, straggler = fault_blocks(evs)
    assert block.count("replicas   rank 1 corrupt (majority; after step 19)") == 1
    assert straggler.startswith("straggler: rank 1 on") and "2.1x its peers' work per step" in straggler


def test_the_events_table_names_a_replaced_rank_as_the_origin() -> None:
    # a SIGKILL of rank 1: the survivor's broken all-reduce with it is posted first, but the row
    # names the dead rank (the agent replaced it in that generation), not the survivor
    from resilient.cli import summarize

    events = [
        ev(1.0, "fault_detected", 0, kind="collective", origin_rank=0, origin_step=12, origin_ts=T0 + 1.0,
           signature="collective:RuntimeError", origin_latency_s=0.0),
        ev(1.01, "rank_replaced", -1, join_generation=0, global_rank=1, cause="killed by SIGKILL",
           last_step=12),
        ev(1.4, "state_restored", 0, generation=1, step=12, steps_rerun=0),
        ev(1.5, "step_resumed", 0, generation=1, step=12),
        ev(1.5, "step_resumed", 1, generation=1, step=12),
    ]  # fmt: skip
    (row,) = summarize(events)
    assert (row["kind"], row["origin_rank"], row["step"]) == ("died", 1, 12)
    assert row["signature"] == "killed by SIGKILL"
    assert row["outcome"] == "recovered" and row["recover_s"] == pytest.approx(0.5)
    # without a replacement the first fault stands
    (row,) = summarize([e for e in events if e["event"] != "rank_replaced"])
    assert (row["kind"], row["origin_rank"]) == ("collective", 0)


def test_the_events_table_counts_the_steps_re_run_by_the_rank_that_re_ran_most() -> None:
    # rank 1 raised at step 12's start while rank 0 was still in step 11: both restore step 8,
    # rank 0 re-runs 3 steps, rank 1 4 (the report's accounting says 4 too)
    from resilient.cli import summarize

    events = [
        ev(1.0, "fault_detected", 1, kind="exception", origin_rank=1, origin_step=12, origin_ts=T0 + 1.0,
           signature="exception:RuntimeError", origin_latency_s=0.0),
        ev(1.1, "state_restored", 0, generation=1, step=8, steps_rerun=3, source="ring"),
        ev(1.1, "state_restored", 1, generation=1, step=8, steps_rerun=4, source="ring"),
        ev(1.2, "step_resumed", 0, generation=1, step=8),
        ev(1.2, "step_resumed", 1, generation=1, step=8),
    ]  # fmt: skip
    (row,) = summarize(events)
    assert (row["steps_rerun"], row["source"]) == (4, "ring")


def under_slurm(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same run with the Slurm place every process's event log adds (rank 1 on node n2)."""
    node = {0: "n1", 1: "n2", -1: "n2"}
    return [{**e, "slurm": {"job": "812345", "step": "0", "node": node[e["rank"]], "requeues": 1}}
            for e in events]  # fmt: skip


def test_report_events_and_metrics_name_the_slurm_job_step_and_node_of_a_fault(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # (rich wraps a wide table's cells at 80)
    log = write_log(tmp_path, under_slurm(in_process_run()))
    assert cli(["events", str(log.parent), "--faults"]) == 0
    out = capsys.readouterr().out
    assert "fault 1: exception on rank 1 on h, pid 101 (Slurm job 812345.0 on n2, requeued 1x)" in out
    assert cli(["report", str(log.parent), "--png", ""]) == 0
    assert "812345.0 on n2" in capsys.readouterr().out
    assert cli(["report", str(log.parent), "--png", "", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["faults"]
    assert row["slurm"] == "job 812345.0 on n2, requeued 1x"
    m = RunMetrics(log, run_id="slurm-812345", refresh_s=0.0, labels={"slurm_job_id": "812345"})
    m.poll(force=True)
    ex = Exporter(m, 0, "127.0.0.1", poll_s=0.05)
    assert ex.start()
    try:
        got = scrape(ex.port)
    finally:
        ex.close()
    for name in ("resilient_faults_total", "resilient_goodput_ratio", "resilient_step", "resilient_run_info"):
        assert {s.labels.get("slurm_job_id") for s in got[name]} == {"812345"}, name
    # outside Slurm the report has no Slurm column
    assert cli(["report", str(write_log(tmp_path / "plain", in_process_run()).parent), "--png", ""]) == 0
    assert "Slurm" not in capsys.readouterr().out


def test_a_preemption_and_the_requeued_run_after_it_are_no_fault() -> None:
    # SIGTERM from Slurm (a requeue): both ranks leave at step 12 for a final checkpoint and exit 76;
    # the agent sees the exits; the requeued run resumes at step 12 in new processes
    evs = [ev(0, "run_started", r, world_size=2) for r in (0, 1)]
    for r in (0, 1):
        evs += steps(r, 1.0, 0, 12, 0.1)
        evs.append(ev(2.35, "fault_detected", r, step=13, kind="preempt", origin_rank=r, origin_step=13,
                      origin_ts=T0 + 2.35, signature="preempt: SIGTERM"))  # fmt: skip
        evs.append(ev(2.5, "run_preempted", r, step=12, error="preempted; final checkpoint at step 12"))
        evs.append(ev(2.6, "worker_died", -1, pid=100 + r, global_rank=r, exitcode=76, cause="exit code 76"))
        evs += steps(r, 20.0, 13, 20, 0.1, pid=500 + r)
    acc = account(evs)
    assert acc.incidents == []
    assert acc.seconds["productive"] > 0 and sum(acc.seconds.values()) == pytest.approx(acc.wall_s)
    from resilient.cli import summarize

    assert summarize(evs) == []
