"""The certificate's arithmetic: figures from an event log, SLO verdicts, config errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos import certify, report, schedule


def _step(ts: float, rank: int, step: int, pid: int, gen: int = 0) -> dict:
    return {"ts": ts, "event": "step_completed", "rank": rank, "step": step, "pid": pid, "generation": gen}


def test_figures_come_from_the_event_log() -> None:
    # 2 ranks, 0.1 s steps; rank 1 is SIGKILLed at t=10.05 after step 4; the agent sees it at
    # 10.10; both ranks are relaunched (new pids) and redo step 3 (their snapshot) at 12.0/12.2
    evs = [_step(10 + 0.1 * s, r, s, pid=100 + r) for s in range(5) for r in (0, 1)]
    evs.append({"ts": 10.5, "event": "worker_died", "rank": -1, "pid": 1})
    evs += [_step(12.0 + 0.1 * (s - 3), 0, s, pid=200) for s in range(3, 10)]
    evs += [_step(12.2 + 0.1 * (s - 3), 1, s, pid=201) for s in range(3, 10)]
    evs.append({"ts": 13.0, "event": "run_finished", "rank": 0, "step": 9})
    m = certify.measure(sorted(evs, key=lambda e: e["ts"]), injected_ts=10.45, nproc=2, ref_step_s=0.1)
    assert m["detect_s"] == pytest.approx(0.05)
    assert m["recover_s"] == pytest.approx(12.2 - 10.45)  # the slower rank's first step after
    assert m["steps_lost"] == 2  # steps 3 and 4 done again
    assert "goodput" not in m  # one goodput, the accounting's, over the whole trial (run_trial)


def test_a_rank_that_never_comes_back_has_no_recovery_figure() -> None:
    evs = [_step(1.0, 0, 0, pid=1), _step(1.0, 1, 0, pid=2), _step(3.0, 0, 1, pid=3)]
    m = certify.measure(evs, injected_ts=2.0, nproc=2, ref_step_s=0.1)
    assert "recover_s" not in m and m["detect_ts"] is None


def _restored(ts: float, rank: int, step: int, pid: int, gen: int, **detail: object) -> dict:
    return {"ts": ts, "event": "state_restored", "rank": rank, "step": step, "pid": pid, "generation": gen,
            **detail}  # fmt: skip


def test_a_fault_found_late_loses_every_step_it_sends_the_run_back() -> None:
    # a bit flips on rank 1 at step 31's start (t=13.05); the replicas' digests differ at step 59,
    # the newest snapshot whose digests agreed is step 8's: 51 steps run again, of which only 23
    # (8-30) were done before the flip
    evs = [_step(10 + 0.1 * s, r, s, pid=100 + r) for s in range(59) for r in (0, 1)]
    evs.append({"ts": 15.95, "event": "fault_detected", "rank": 0, "step": 59, "pid": 100, "generation": 0})
    evs += [_restored(16.2, r, 8, 100 + r, 1, steps_rerun=51, source="ring") for r in (0, 1)]
    evs += [_step(16.3 + 0.1 * (s - 8), r, s, pid=100 + r, gen=1) for s in range(8, 80) for r in (0, 1)]
    # a later fault's recovery, further back still: not this fault's cost
    evs += [_restored(30.0, r, 5, 100 + r, 2, steps_rerun=70, source="ring") for r in (0, 1)]
    m = certify.measure(sorted(evs, key=lambda e: e["ts"]), injected_ts=13.05, nproc=2, ref_step_s=0.1)
    assert m["steps_lost"] == 51 and m["source"] == "ring"
    assert m["detect_step"] == 59


def test_a_replaced_rank_loses_the_steps_since_the_snapshot() -> None:
    # rank 1 SIGKILLed after step 14; rank 0 stays (pid 100) and restores step 13 from its ring,
    # the replacement (pid 201) from the shared-memory mirror: steps 13 and 14 run again
    evs = [_step(10 + 0.1 * s, r, s, pid=100 + r) for s in range(15) for r in (0, 1)]
    evs.append({"ts": 11.5, "event": "worker_died", "rank": -1, "pid": 1})
    evs.append(_restored(12.0, 0, 13, 100, 1, steps_rerun=2, source="ring"))
    evs.append(_restored(12.1, 1, 13, 201, 1, steps_rerun=0, source="shm"))
    evs += [
        _step(12.2 + 0.1 * (s - 13), r, s, pid=(100, 201)[r], gen=1) for s in range(13, 20) for r in (0, 1)
    ]
    m = certify.measure(sorted(evs, key=lambda e: e["ts"]), injected_ts=11.45, nproc=2, ref_step_s=0.1)
    assert m["steps_lost"] == 2 and m["source"] == "ring+shm"


def test_an_exception_resumed_live_loses_nothing() -> None:
    # rank 1 raises in step 15 (t=11.45); every rank resumes step 15 from its live state
    evs = [_step(10 + 0.1 * s, r, s, pid=100 + r) for s in range(15) for r in (0, 1)]
    evs.append({"ts": 11.46, "event": "fault_detected", "rank": 1, "step": 15, "pid": 101, "generation": 0})
    evs += [_restored(11.5, r, 15, 100 + r, 1, steps_rerun=0, source="live") for r in (0, 1)]
    evs += [_step(11.6 + 0.1 * (s - 15), r, s, pid=100 + r, gen=1) for s in range(15, 20) for r in (0, 1)]
    m = certify.measure(sorted(evs, key=lambda e: e["ts"]), injected_ts=11.45, nproc=2, ref_step_s=0.1)
    assert m["steps_lost"] == 0 and m["source"] == "live"


def test_the_first_recovery_is_one_restore_per_rank_of_one_generation() -> None:
    # a relaunched job restores at generation 0 in new processes, and again after a second relaunch
    evs = [_restored(5.0, 0, 3, 1, 0, source="old")]  # (before the fault)
    evs += [_restored(10.0 + r, r, 13, 200 + r, 0, source="shm") for r in (0, 1)]
    evs += [_restored(20.0 + r, r, 10, 300 + r, 0, source="disk") for r in (0, 1)]
    assert [e["pid"] for e in certify.first_recovery(evs, 6.0)] == [200, 201]
    evs = [_restored(10.0, 0, 13, 100, 1), _restored(11.0, 0, 12, 100, 2), _restored(11.5, 1, 12, 101, 2)]
    assert [e["generation"] for e in certify.first_recovery(evs, 6.0)] == [1]
    assert certify.first_recovery(evs, 12.0) == []


def test_a_fault_with_nothing_to_act_on_is_skipped_with_why_never_failed() -> None:
    from chaos.inject import NotActed

    why = [NotActed("desync", 15, 1, "the rank had no gradient all-reduce to skip")]
    t = certify.Trial("k", 0, 15, ok=True)
    certify.unacted(t, why)
    assert t.skipped == "desync@15:1 did not act: the rank had no gradient all-reduce to skip"
    assert not t.error
    t = certify.Trial("k", 0, 15, ok=False, error="launcher exited 1")  # the job failed on its own
    certify.unacted(t, why)
    assert not t.skipped and t.error.startswith("launcher exited 1 (desync@15:1 did not act")
    t = certify.Trial("k", 0, 15, ok=True)
    certify.unacted(t, [])  # nothing fired at all: the rank never got there
    assert not t.skipped and "never fired" in t.error


def _cert(**slo: object) -> schedule.Certification:
    classes = {"k": {"fault": "sigkill", "step": 5, "slo": slo}}
    return schedule.Certification.model_validate({"classes": classes})


def test_slo_verdicts_name_what_failed() -> None:
    cert = _cert(detect_s=1.0, recover_s=5.0, goodput_min=0.5)
    t = certify.Trial("k", 0, 5, ok=True, detect_s=2.0, recover_s=4.0, goodput=0.4, bit_exact=True)
    assert certify._check(t, cert) == ["detect_s", "goodput"]
    t = certify.Trial("k", 0, 5, ok=True, detect_s=0.5, recover_s=None, bit_exact=False)
    assert certify._check(t, cert) == ["recover_s", "goodput", "bit_exact"]  # no figure: no pass


def test_a_fault_that_raises_nothing_is_judged_by_where_it_was_caught_and_who_was_named() -> None:
    # rank 1's weights flipped at step 6 (t=10.6): caught at step 6 by the guard, or named by the
    # replicas' digests, rank 1 and no other
    evs = [_step(10 + 0.1 * s, r, s, pid=100 + r) for s in range(6) for r in (0, 1, 2)]
    evs.append({"ts": 10.62, "event": "fault_detected", "rank": 0, "step": 6})
    evs.append({"ts": 10.63, "event": "sdc_detected", "rank": 0, "step": 5, "ranks": [1]})
    m = certify.measure(sorted(evs, key=lambda e: e["ts"]), injected_ts=10.6, nproc=3, ref_step_s=0.1)
    assert (m["detect_step"], m["named_ranks"]) == (6, [1])
    cert = _cert(detect_at_step=True, names_rank=True)  # (the class's planned rank: 1)
    good = certify.Trial("k", 0, 6, ok=True, detect_step=6, named_ranks=[1], bit_exact=True)
    assert certify._check(good, cert) == []
    bad = certify.Trial("k", 0, 6, ok=True, detect_step=7, named_ranks=[0, 1], bit_exact=True)
    assert certify._check(bad, cert) == ["detect_at_step", "names_rank"]


def test_a_warm_replacement_is_certified_only_when_a_standby_waited(tmp_path: Path) -> None:
    # the harness's tail follows the launcher's standbys: one ready, then used by a replacement
    import json

    from chaos.runner import Tail

    runs = tmp_path / "resilient_runs" / "r"
    runs.mkdir(parents=True)
    log = runs / "events.jsonl"
    tail = Tail(tmp_path)
    log.write_text(json.dumps({"ts": 1, "event": "standby_ready", "rank": -1, "standby_pid": 7,
                               "warmth": "parked"}) + "\n")  # fmt: skip
    tail.poll()
    assert tail.standbys == {7: "parked"}
    with open(log, "a") as f:
        used = {"ts": 2, "event": "rank_replaced", "rank": -1, "new_pid": 7, "standby": True}
        f.write(json.dumps(used) + "\n")
    tail.poll()
    assert tail.standbys == {}
    cert = _cert(recover_s=1.0, standby_ready=True)
    warm = certify.Trial("k", 0, 5, ok=True, recover_s=0.5, bit_exact=True, standby="parked")
    assert certify._check(warm, cert) == []
    cold = certify.Trial("k", 0, 5, ok=True, recover_s=0.5, bit_exact=True, standby="none")
    assert certify._check(cold, cert) == ["standby_ready"]
    # both figures, side by side: the replacements a standby took, and the cold ones
    more = [certify.Trial("k", i, 5, ok=True, recover_s=x, bit_exact=True, standby="parked") for i, x in
            ((1, 0.4), (2, 0.6))]  # fmt: skip
    (row,) = report.summarize(_cert(recover_s=3.0), [warm, cold, *more])
    assert row["recover_p50_by_standby"] == {"none": 0.5, "parked": 0.5}
    cold.recover_s = 2.0
    (row,) = report.summarize(_cert(recover_s=3.0), [warm, cold, *more])
    assert row["recover_p50_by_standby"] == {"none": 2.0, "parked": 0.5}


def test_summary_counts_skipped_classes_apart() -> None:
    cert = _cert()
    rows = report.summarize(cert, [certify.Trial("k", 0, 5, skipped="no cgroup v1 memory controller")])
    assert rows == [{"class": "k", "trials": 0, "skipped": "no cgroup v1 memory controller", "failed": [],
                     "errors": []}]  # fmt: skip


def test_config_errors_name_the_file_and_field(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("job: {steps: 10}\nclasses:\n  odd: {fault: teleport, step: 2}\n")
    with pytest.raises(schedule.BadInput) as e:
        schedule.load(cfg)
    assert str(cfg) in str(e.value) and "classes.odd.fault" in str(e.value)
    cfg.write_text("job: {steps: 10}\nclasses:\n  late: {fault: hang, step: 9}\n")
    with pytest.raises(schedule.BadInput, match=r"classes\.late\.step: 9"):
        schedule.load(cfg)


def test_trial_steps_are_reproducible_under_the_seed() -> None:
    cert = schedule.Certification.model_validate(
        {"seed": 7, "classes": {"k": {"fault": "hang", "step": 15, "jitter": 3}}}
    )
    steps = [cert.trial_step("k", t) for t in range(20)]
    assert steps == [cert.trial_step("k", t) for t in range(20)]
    assert set(steps) <= set(range(12, 19)) and len(set(steps)) > 1


def test_stream_plan_spaces_faults_and_sizes_the_run() -> None:
    from chaos import stream

    st = {"mtbf_s": 60, "faults": 4, "kinds": ["hang", "sigkill"]}
    cert = schedule.Certification.model_validate({"job": {"nproc": 2}, "classes": {}, "stream": st})
    faults, steps = stream.plan(cert, step_s=0.05)
    assert [f.at_s for f in faults] == [60, 120, 180, 240]
    assert {f.fault for f in faults} <= {"hang", "sigkill"} and {f.rank for f in faults} <= {0, 1}
    assert [s for s, _ in stream.at_step(faults, 0.05)] == [1200, 2400, 3600, 4800]
    assert steps == int((240 + 30) / 0.05) + 1  # half an interval of clean running after the last
    assert cert.stream is not None
    soak = cert.model_copy(update={"stream": cert.stream.model_copy(update={"random": True, "faults": 200})})
    times = [f.at_s for f in stream.plan(soak, 0.05)[0]]
    assert times == sorted(times) and len(set(times)) == 200
    assert 0.5 * 60 < times[-1] / 200 < 1.5 * 60  # exponential gaps with the configured mean
    assert stream.plan(soak, 0.05) == stream.plan(soak, 0.05)  # the seed decides


def test_link_fault_configs_are_checked() -> None:
    with pytest.raises(ValueError, match=r"classes\.lossy\.arg: link_loss needs the %"):
        schedule.Certification.model_validate({"classes": {"lossy": {"fault": "link_loss", "step": 5}}})
    with pytest.raises(ValueError, match=r"kinds: \['link_loss'\] cannot run in a stream"):
        schedule.Certification.model_validate({"classes": {}, "stream": {"kinds": ["sigkill", "link_loss"]}})
    with pytest.raises(ValueError, match=r"schedule: link faults on ranks \[0, 1\]"):
        schedule.Certification.model_validate(
            {
                "schedule": [
                    {"fault": "link_drop", "rank": 0, "step": 3},
                    {"fault": "link_drop", "rank": 1, "step": 9},
                ]
            }
        )
    with pytest.raises(ValueError, match=r"exactly one of step / at_s"):
        schedule.Planned(fault="hang", step=3, at_s=1.0)


def test_link_recovery_is_judged_from_the_link_s_return() -> None:
    cert = schedule.Certification.model_validate(
        {"classes": {"k": {"fault": "link_drop", "step": 5, "slo": {"recover_after_restore_s": 15}}}}
    )
    t = certify.Trial("k", 0, 5, ok=True, recover_s=24.0, recover_after_restore_s=14.0, bit_exact=True)
    assert certify._check(t, cert) == []
    t = certify.Trial("k", 0, 5, ok=True, recover_s=27.0, recover_after_restore_s=17.0, bit_exact=True)
    assert certify._check(t, cert) == ["recover_after_restore_s"]


def test_event_tail_reads_only_new_complete_lines(tmp_path: Path) -> None:
    from chaos.runner import Tail

    log = tmp_path / "resilient_runs" / "r1" / "events.jsonl"
    log.parent.mkdir(parents=True)
    log.write_text('{"event": "run_started", "rank": 1, "pid": 7, "step": null}\n'
                   '{"event": "step_completed", "rank": 1, "pid": 7, "step": 4}\n'
                   '{"event": "step_comp')  # fmt: skip
    tail = Tail(tmp_path)
    tail.poll()
    assert tail.reached == {1: (4, 7)}
    with open(log, "a") as f:  # the half-written line completes; a relaunched process starts over
        f.write('leted", "rank": 1, "pid": 7, "step": 5}\n{"event": "run_started", "rank": 1, "pid": 9}\n')
    tail.poll()
    assert tail.reached == {1: (-1, 9)}


def test_schedule_entries_become_in_process_plans() -> None:
    from chaos import stream

    faults = [schedule.Planned(fault="oom", rank=1, step=40, repeat=2),
              schedule.Planned(fault="stall", rank=0, at_s=1.0)]  # fmt: skip
    placed = stream.at_step(faults, 0.05)
    assert [(s, f.fault) for s, f in placed] == [(20, "stall"), (40, "oom")]
    assert [f.spec(s) for s, f in placed] == ["stall@20:0=30", "oom@40:1x2"]


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "configs" / "chaos").glob("*.yaml")))
def test_every_shipped_chaos_config_validates(path: Path) -> None:
    from chaos import soak
    from chaos.schedule import load

    if path.name == "soak.yaml":  # (the soak's own schema: its stacks name certificate configs)
        spec = soak.load(path)
        assert all(load(Path(__file__).parents[2] / s.config) for s in spec.stacks.values())
        return
    cert = load(path)
    assert cert.classes or cert.schedule or cert.stream is not None


def test_the_standby_a_rank_faulting_on_itself_found_is_read_from_the_agents_events() -> None:
    # a gil_hang fires inside the rank: the harness did not see which standby waited then
    from chaos.runner import standby_at

    evs = [
        {"ts": 1.0, "event": "standby_ready", "rank": -1, "standby_pid": 7, "warmth": "imported"},
        {"ts": 2.0, "event": "rank_replaced", "rank": -1, "new_pid": 7, "standby": True},
        {"ts": 3.0, "event": "standby_ready", "rank": -1, "standby_pid": 9, "warmth": "parked"},
    ]
    assert standby_at(evs, 0.5) == "none"
    assert standby_at(evs, 1.5) == "imported"
    assert standby_at(evs, 2.5) == "none"  # promoted: it waits no more
    assert standby_at(evs, 3.5) == "parked"


def test_a_phase_over_its_budget_fails_the_class_even_when_the_total_passes() -> None:
    cert = _cert(recover_s=1.0, recover_p50_s=0.12, phase_p50_s={"free": 0.005, "rebuild": 0.02})

    def trial(i: int, recover: float, free: float | None) -> certify.Trial:
        t = certify.Trial("k", i, 5, ok=True, recover_s=recover, bit_exact=True)
        t.phases = {"free": free, "rebuild": 0.004}
        return t

    (row,) = report.summarize(cert, [trial(0, 0.09, 0.002), trial(1, 0.10, 0.003), trial(2, 0.5, 0.09)])
    assert row["failed"] == [] and row["phases_p50"]["free"] == 0.003  # (a median: one slow trial)
    (row,) = report.summarize(cert, [trial(0, 0.09, 0.009), trial(1, 0.10, 0.008), trial(2, 0.11, 0.001)])
    assert row["failed"] == ["phase:free"]  # every trial's total within its SLO, the phase not
    (row,) = report.summarize(cert, [trial(0, 0.13, 0.001), trial(1, 0.2, None), trial(2, 0.11, None)])
    assert row["failed"] == ["recover_p50_s"]  # (free's median of the trials that have it: 1 ms)
    (row,) = report.summarize(cert, [trial(0, 0.09, None)])
    assert row["failed"] == ["phase:free"]  # no figure is no pass
    assert "free" in str(report.phase_table([row]).columns[5].header)


def test_a_phases_cpu_time_is_held_to_its_own_budget_whatever_its_wall_time() -> None:
    cert = _cert(recover_s=1.0, phase_cpu_p50_s={"restore": 0.015})

    def trial(i: int, wall: float, cpu: float | None) -> certify.Trial:
        t = certify.Trial("k", i, 5, ok=True, recover_s=0.1, bit_exact=True)
        t.phases, t.phase_cpu = {"restore": wall}, {"restore": cpu}
        return t

    # a rank descheduled mid-copy: 196 ms of wall time, 5 ms of work
    (row,) = report.summarize(cert, [trial(0, 0.196, 0.005)])
    assert row["failed"] == [] and row["phases_cpu_p50"]["restore"] == 0.005
    (row,) = report.summarize(cert, [trial(0, 0.02, 0.030), trial(1, 0.02, 0.031), trial(2, 0.02, 0.004)])
    assert row["failed"] == ["cpu:restore"]  # the work itself grew (a copy too many)
    (row,) = report.summarize(cert, [trial(0, 0.02, None)])
    assert row["failed"] == ["cpu:restore"]  # no figure is no pass
    assert "cpu" in str(report.phase_table([row]).columns[0]._cells)


def test_a_budget_for_a_phase_that_is_not_one_is_refused_by_name(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    slo = "slo: {phase_p50_s: {fre: 0.005}}"
    cfg.write_text(f"job: {{steps: 40}}\nclasses:\n  k: {{fault: exception, step: 5, {slo}}}\n")
    with pytest.raises(schedule.BadInput, match=r"classes\.k\.slo\.phase_p50_s\.fre"):
        schedule.load(cfg)


def test_a_class_step_given_as_a_share_fits_the_job_length_given_on_the_command_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "job: {steps: 200}\n"
        "classes:\n"
        "  early: {fault: exception, step: '30%'}\n"
        "  late: {fault: exception, step: '75%', job: {steps: 40}}\n"
        "  fixed: {fault: exception, step: 12}\n"
    )
    steps = {n: c.step for n, c in schedule.load(cfg).classes.items()}
    assert steps == {"early": 60, "late": 30, "fixed": 12}  # (a class's own job.steps decides its)
    steps = {n: c.step for n, c in schedule.load(cfg, steps=60).classes.items()}
    assert steps == {"early": 18, "late": 30, "fixed": 12}
    cfg.write_text("classes:\n  bad: {fault: exception, step: 'lots%'}\n")
    with pytest.raises(schedule.BadInput, match="not a share"):
        schedule.load(cfg)


def test_a_job_of_nodes_spreads_its_ranks_evenly_and_a_spare_stands_beside_two_or_more() -> None:
    ok = schedule.Certification.model_validate(
        {"job": {"nproc": 4, "nodes": 2, "spare": True}, "classes": {}}
    )
    assert (ok.job.nodes, ok.job.spare) == (2, True)
    with pytest.raises(ValueError, match="nproc 3 is not a multiple of nodes 2"):
        schedule.Certification.model_validate({"job": {"nproc": 3, "nodes": 2}, "classes": {}})
    with pytest.raises(ValueError, match="nodes: 2 or more"):
        schedule.Certification.model_validate({"job": {"nproc": 2, "spare": True}, "classes": {}})


def test_the_lost_node_config_is_a_job_of_two_nodes_and_a_spare() -> None:
    cert = schedule.load(Path("configs/chaos/nodes.yaml"))
    assert (cert.job.nodes, cert.job.spare) == (2, True)
    assert {c.fault for c in cert.classes.values()} == {"lose_node"}
