"""The JSONL event log: one record per line, readable after a writer was killed mid-line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from resilient.events import Event, EventLog, read_events


def test_each_emit_appends_one_json_line(tmp_path: Path):
    path = tmp_path / "run" / "events.jsonl"  # the directory is created
    log = EventLog(path, rank=3)
    try:
        r1 = log.emit(Event.FAULT_DETECTED, generation=1, step=17, kind="hang", idle_s=61.5)
        log.emit(Event.STATE_RESTORED, generation=2, step=None, from_step=16)
    finally:
        log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first == r1
    assert {"ts", "event", "rank", "pid", "generation", "step"} <= first.keys()
    assert first["event"] == "fault_detected" and first["rank"] == 3 and first["pid"] == os.getpid()
    assert (first["generation"], first["step"], first["kind"], first["idle_s"]) == (1, 17, "hang", 61.5)
    second = json.loads(lines[1])
    assert second["step"] is None and second["from_step"] == 16 and second["ts"] >= first["ts"]


def test_ranks_append_to_the_same_file(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    logs = [EventLog(path, rank=r) for r in range(3)]
    for g in range(2):
        for log in logs:
            log.emit(Event.STEP_RESUMED, generation=g, step=g)
    for log in logs:
        log.close()
        log.close()  # idempotent
    assert sorted((e["generation"], e["rank"]) for e in read_events(path)) == [
        (g, r) for g in range(2) for r in range(3)
    ]


def test_non_serializable_fields_do_not_break_the_log(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, rank=0)
    log.emit(Event.RUN_STARTED, generation=0, step=None, out=tmp_path)
    log.close()
    assert read_events(path)[0]["out"] == str(tmp_path)


def test_read_events_skips_a_torn_last_line(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path, rank=0)
    log.emit(Event.RUN_STARTED, generation=0, step=None)
    log.emit(Event.FAULT_DETECTED, generation=0, step=4)
    log.close()
    with open(path, "a") as f:
        f.write('{"ts": 1.0, "event": "group_ab')  # the writer was killed mid-record
    events = read_events(path)
    assert [e["event"] for e in events] == ["run_started", "fault_detected"]


def test_unwritable_log_does_not_raise(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = EventLog(blocker / "sub" / "events.jsonl", rank=0)  # cannot create the directory
    rec = log.emit(Event.RUN_FAILED, generation=0, step=1, reason="x")
    log.close()
    assert rec["event"] == "run_failed"
    assert EventLog(None, rank=0).emit(Event.RUN_FINISHED, generation=0, step=2)["step"] == 2
