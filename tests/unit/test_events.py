"""The JSONL event log: one record per line, readable after a writer was killed mid-line."""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterator
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


def test_under_slurm_every_record_names_the_job_step_and_node(tmp_path: Path):
    from resilient.launch_env import LaunchEnv, SlurmPlace

    env = {"SLURM_JOB_ID": "812345", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "n2",
           "SLURM_RESTART_COUNT": "2"}  # fmt: skip
    launch = LaunchEnv.from_environ(env)
    assert launch.slurm == SlurmPlace(job="812345", step="0", node="n2", requeues=2)
    assert LaunchEnv.from_environ({}).slurm is None
    assert SlurmPlace.from_environ({"SLURM_JOB_ID": "7"}) == SlurmPlace("7", None, None, 0)
    with EventLog(tmp_path / "events.jsonl", rank=1, **launch.slurm.fields()) as log:
        rec = log.emit(Event.FAULT_DETECTED, generation=0, step=3, kind="exception")
    assert rec["slurm"] == {"job": "812345", "step": "0", "node": "n2", "requeues": 2}
    assert read_events(tmp_path / "events.jsonl") == [rec]


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


# ---- readers name events by the enum ---------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
EVENT_NAMES = {e.value for e in Event}
# (path, literal) -> why a literal spelled as an event is no event's name there; none today
ALLOWED: dict[tuple[str, str], str] = {}
_DICT_LOOKUPS = {"get", "setdefault", "pop"}


def _containers(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and, where it is a literal collection of names (a tuple, list or set, or one
    wrapped in ``frozenset()``/``set()``/``tuple()``, or either branch of a conditional), its
    elements."""
    if isinstance(node, ast.IfExp):
        yield from _containers(node.body)
        yield from _containers(node.orelse)
        return
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("frozenset", "set", "tuple")
        and len(node.args) == 1
    ):
        yield from _containers(node.args[0])
        return
    yield node
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        yield from node.elts


def _event_literals(tree: ast.AST) -> Iterator[ast.Constant]:
    """The string constants of ``tree`` used as an event's name: an operand of a comparison (or
    an element of a collection that is one), an element of a collection bound to a name that is
    tested with ``in``, or iterated over, a dict literal's key, a constant key looked up in a
    mapping (``x[K]``, ``x.get(K)``, ``x.setdefault(K)``, ``x.pop(K)``), and the evidence a fault
    kind is detected by (``Evidence(...)``, ``detection=``)."""
    tested: set[str] = set()  # names used on the right of `in` / `not in`
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, ast.In | ast.NotIn) and isinstance(right, ast.Name | ast.Attribute):
                    tested.add(ast.unparse(right))
    uses: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            uses += [node.left, *node.comparators]
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t) in tested for t in targets):
                uses.append(node.value)
        elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
            uses.append(node.iter)
        elif isinstance(node, ast.Dict):
            uses += [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Subscript):
            uses.append(node.slice)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _DICT_LOOKUPS and node.args:
                uses.append(node.args[0])
            if isinstance(func, ast.Name) and func.id == "Evidence":
                uses += node.args
            uses += [kw.value for kw in node.keywords if kw.arg == "detection"]
    for use in uses:
        for n in _containers(use):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in EVENT_NAMES:
                yield n


def _misspelled(source: str, path: str) -> list[str]:
    lines = source.splitlines()
    return sorted(
        {
            f"{path}:{c.lineno}: {c.value!r} (Event.{Event(c.value).name}): {lines[c.lineno - 1].strip()}"
            for c in _event_literals(ast.parse(source, path))
            if (path, c.value) not in ALLOWED
        }
    )


def test_readers_name_events_by_the_enum():
    """An event's name is spelled once, in :class:`Event`: a reader that compared records with a
    string literal would silently stop matching when the event is renamed."""
    files = sorted(p for d in ("resilient", "chaos") for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 50
    found = []
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        if rel != "resilient/events.py":
            found += _misspelled(f.read_text(), rel)
    assert not found, "name these events by resilient.events.Event:\n" + "\n".join(found)
    assert all((ROOT / path).is_file() for path, _ in ALLOWED)  # (an entry outliving its file)


def test_the_event_literal_check_sees_each_kind_of_use():
    flagged = [
        'e["event"] == "fault_detected"',
        'e.get("event") != "run_failed"',
        'ev in ("progress", "step_completed")',
        'ev not in {"worker_died"}',
        'ev in frozenset({"heartbeat_missed"})',
        'KINDS = {"step_completed"} if exact else {"progress"}\nok = ev in KINDS',
        '{"worker_died": 1}',
        'own.get("restore_agreed")',
        'own["group_rebuilt"]',
        'per.setdefault("state_restored", e)',
        'for k in ("fault_detected", "group_aborted"): pass',
        'E = Evidence("fault", ("checkpoint_slow",), False)',
        'Evidence("fault", detection=("sdc_detected",), restarts=True)',
    ]
    for src in flagged:
        assert _misspelled(src, "x.py"), src
    fine = [
        "ev == Event.FAULT_DETECTED",
        'name in (Event.GROUP_REBUILT, "step")',  # a phase's own name
        'failed.append("standby_ready")',  # an SLO's name, spelled as the event
        'getattr(t, "peer_wait", None)',  # an attribute
        'x = ("progress",)',  # a tuple no one tests membership of
        'print("progress")',
    ]
    for src in fine:
        assert not _misspelled(src, "x.py"), src
