"""What a checkpoint directory's contents can and cannot do to a load: every edit the issue tried
by hand (each a regression test naming its message), then property-based fuzzing over real
checkpoints written by the project (``FUZZ_EXAMPLES`` cases; the nox ``fuzz`` session runs more).

Each case either loads the state bit-identical to what was saved, or raises ``CheckpointError``
and falls back to the previous checkpoint; never another exception, never an allocation larger
than the files on disk. An edit that is *resealed* (the manifest's digest recomputed, as someone
with write access can) may change what loads; it still never crashes the reader or allocates
more than the files hold."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from resilient.checkpoint import reader
from resilient.checkpoint.manager import Checkpointer
from resilient.checkpoint.manifest import MANIFEST, Manifest, manifest_digest, step_name
from resilient.checkpoint.reader import load_latest
from resilient.errors import CheckpointError
from tests.unit.test_checkpoint import _equal, _model_state, _plain

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))


def _save_two(root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Steps 1 and 2 of a real model, optimizer and scheduler (step 2 incremental on step 1)."""
    first, second = _model_state(0), _model_state(1)
    with Checkpointer(root, token="t") as ck:
        ck.save(1, first)
        ck.wait()
        ck.save(2, second)
        ck.wait()
    return _plain(first), _plain(second)


@pytest.fixture(autouse=True)
def address_space_cap() -> Iterator[None]:
    """4 GiB more address space than the process holds now, while a case runs: an allocation a
    malformed input drives (a list of 10**12 ranks, say) is a MemoryError here, not the machine's
    OOM killer taking whatever process is largest."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    held = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    cap = held + (4 << 30)
    if hard != resource.RLIM_INFINITY and cap > hard:
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture(scope="module")
def base() -> Iterator[tuple[Path, dict[str, Any], dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as d:
        first, second = _save_two(Path(d) / "ck")
        yield Path(d) / "ck", first, second


def _edit(root: Path, step: int, fn: Any, reseal: bool) -> None:
    path = root / step_name(step) / MANIFEST
    m = json.loads(path.read_text())
    fn(m)
    if reseal:  # what someone with write access does: recompute the digest over the edit
        m.pop("digest", None)
        m["digest"] = manifest_digest(m)
    path.write_text(json.dumps(m))


@pytest.fixture
def ck(tmp_path: Path, base: tuple[Path, dict[str, Any], dict[str, Any]]) -> Path:
    shutil.copytree(base[0], tmp_path / "ck")
    return tmp_path / "ck"


def _falls_back(root: Path, first: dict[str, Any], match: str) -> None:
    loaded = load_latest(root, 0, 1)
    assert loaded is not None and loaded.step == 1, "the previous checkpoint should load"
    _equal(first, loaded.state)
    assert len(loaded.rejected) == 1 and match in loaded.rejected[0], loaded.rejected


def _tensor(m: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return m["ranks"][0]["tensors"][i]


# -- the table, one regression test each ------------------------------------------------------
def test_a_manifest_edited_in_place_is_refused_as_edited(ck: Path, base: Any) -> None:
    _edit(ck, 2, lambda m: _tensor(m).update(shape=[10**12]), reseal=False)
    _falls_back(ck, base[1], "manifest edited or corrupt: its content does not match its digest")


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        (
            "shape 10**12",
            lambda m: _tensor(m).update(shape=[10**12]),
            "manifest field ranks.0.tensors.0: Value error, tensor ",
        ),
        (
            "shape 10**12 and nbytes to match",
            lambda m: _tensor(m).update(shape=[10**12], nbytes=4 * 10**12),
            "runs past the end of the file",
        ),
        ("offset -8", lambda m: _tensor(m).update(offset=-8), "manifest field ranks.0.tensors.0.offset"),
        (
            "dtype object",
            lambda m: _tensor(m).update(dtype="object"),
            "dtype 'object' is not one a checkpoint holds",
        ),
        (
            "skeleton index out of range",
            lambda m: m["ranks"][0].update(skeleton={"T": 10_000}),
            "skeleton refers to tensor 10000",
        ),
        (
            "skeleton index -1",
            lambda m: m["ranks"][0].update(skeleton={"T": -1}),
            "skeleton refers to tensor -1",
        ),
        (
            "a file outside the root",
            lambda m: _tensor(m).update(file="/etc/passwd"),
            "escapes the checkpoint",
        ),
        ("world size 3 of 1 rank", lambda m: m.update(world_size=3), "manifest field (top level)"),
        ("step -1", lambda m: m.update(step=-1), "manifest field step"),
        (
            "world size 10**12",
            lambda m: m.update(world_size=10**12),
            "ranks [0] for world size 1000000000000",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) and len(x) < 40 else "",
)
def test_a_resealed_edit_is_refused_naming_file_and_field(
    ck: Path, base: Any, name: str, edit: Any, message: str
) -> None:
    _edit(ck, 2, edit, reseal=True)
    _falls_back(ck, base[1], message)
    rejected = load_latest(ck, 0, 1).rejected[0]  # type: ignore[union-attr]
    assert str(ck / step_name(2)) in rejected, rejected  # the file is named


def test_a_saved_manifest_carries_its_digest(ck: Path) -> None:
    m = json.loads((ck / step_name(2) / MANIFEST).read_text())
    assert len(m["digest"]) == 32
    assert Manifest.model_validate(m).content_digest() == m["digest"]


def test_a_manifest_without_a_digest_is_read_as_before(ck: Path, base: Any) -> None:
    _edit(ck, 2, lambda m: m.pop("digest"), reseal=False)
    loaded = load_latest(ck, 0, 1)
    assert loaded is not None and loaded.step == 2
    _equal(base[2], loaded.state)


# -- fuzzing ---------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, -1, -8, 1, 2**31, 2**63, 10**12])
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.sampled_from(["../x", "/etc/passwd", "object", "float32", "step-00000001/rank00000.bin", "T", "d"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["T", "d", "a", "x"]), inner, max_size=2)
    ),
    max_leaves=6,
)


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path] if path else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _leaves(v, (*path, i))
    return out


def _set(node: Any, path: tuple[Any, ...], value: Any) -> None:
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


class Bounded:
    """``torch`` for the reader, with every allocation's size checked against the files on disk."""

    def __init__(self, limit: int) -> None:
        self.limit, self.biggest = limit, 0

    def empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= int(d)
        self.biggest = max(self.biggest, n * dtype.itemsize)
        assert n * dtype.itemsize <= self.limit, f"allocation of {n * dtype.itemsize} bytes"
        return torch.empty(shape, dtype=dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _load_and_judge(root: Path, first: dict[str, Any], second: dict[str, Any], may_differ: bool) -> str:
    limit = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    bounded = Bounded(limit)
    saved = reader.torch
    reader.torch = bounded  # type: ignore[assignment]
    try:
        loaded = load_latest(root, 0, 1)
    except CheckpointError as e:  # (both gone: the message names each)
        assert "step-00000002" in str(e) or "step-00000001" in str(e), e
        return "refused"
    finally:
        reader.torch = saved
    assert loaded is not None
    if loaded.step == 1:
        assert loaded.rejected and "step-00000002" in loaded.rejected[0], loaded.rejected
        _equal(first, loaded.state)
        return "fell back"
    if not may_differ:
        _equal(second, loaded.state)
    return "loaded"


@pytest.mark.filterwarnings("ignore:Generating overly large repr")
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), reseal=st.booleans())
def test_fuzz_manifest_fields(base: Any, data: st.DataObject, reseal: bool) -> None:
    root0, first, second = base
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "ck"
        shutil.copytree(root0, root)
        m = json.loads((root / step_name(2) / MANIFEST).read_text())
        for _ in range(data.draw(st.integers(1, 3))):
            paths = _leaves(m)  # (half the time a field near the top: step, world size, a rank's)
            shallow = [p for p in paths if len(p) <= 3]
            _set(m, data.draw(st.sampled_from(shallow) | st.sampled_from(paths)), data.draw(json_values))
        (root / step_name(2) / MANIFEST).write_text(json.dumps(m))
        if reseal:
            _edit(root, 2, lambda m: None, reseal=True)
        event(
            ("resealed: " if reseal else "edited: ") + _load_and_judge(root, first, second, may_differ=reseal)
        )


@pytest.mark.filterwarnings("ignore:Generating overly large repr")
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    which=st.sampled_from([MANIFEST, "rank00000.bin"]),
    how=st.sampled_from(["flip", "truncate", "append", "zero"]),
)
def test_fuzz_bytes_of_manifest_and_shard(base: Any, data: st.DataObject, which: str, how: str) -> None:
    root0, first, second = base
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "ck"
        shutil.copytree(root0, root)
        path = root / step_name(2) / which
        raw = bytearray(path.read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1))
        if how == "flip":
            raw[at] ^= data.draw(st.integers(1, 255))
        elif how == "truncate":
            del raw[at:]
        elif how == "append":
            raw += data.draw(st.binary(min_size=1, max_size=64))
        else:
            n = len(raw[at : at + data.draw(st.integers(1, 4096))])
            raw[at : at + n] = bytes(n)
        path.write_bytes(bytes(raw))
        # a changed byte is never loaded as if it were the saved state
        event(f"{which} {how}: " + _load_and_judge(root, first, second, may_differ=False))


# -- command lines: a bad value is a usage error naming the flag (exit 2), never a traceback ----------
def _usage_error(capsys: pytest.CaptureFixture[str], fn: Any, *args: Any) -> str:
    try:
        rc = fn(*args)
    except SystemExit as e:  # argparse's own
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, (rc, err)
    return err


def test_plan_refuses_a_negative_mtbf(capsys: pytest.CaptureFixture[str]) -> None:
    from resilient.cli import main

    err = _usage_error(capsys, main, ["plan", "--mtbf-h", "-1", "--write-s", "1", "--restart-s", "1"])
    assert "argument --mtbf-h: must be > 0: -1" in err


def test_launch_refuses_a_worker_count_that_is_not_one(capsys: pytest.CaptureFixture[str]) -> None:
    from resilient.launcher.cli import parse

    err = _usage_error(capsys, parse, ["--nproc-per-node", "two", "train.py"])
    assert "argument --nproc-per-node" in err and "'two'" in err


def test_chaos_refuses_a_bad_plan_and_a_missing_config(capsys: pytest.CaptureFixture[str]) -> None:
    from chaos.cli import main

    assert "argument plan: bad fault spec 'boom@x'" in _usage_error(capsys, main, ["check", "boom@x"])
    assert "cannot read" in _usage_error(capsys, main, ["certify", "/nonexistent/chaos.yaml"])


def test_checkpoints_verify_lists_every_step_directory_with_why(
    ck: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from resilient.cli import main

    _edit(ck, 2, lambda m: _tensor(m).update(offset=-8), reseal=True)
    (ck / "step-5").mkdir()
    (ck / "step-00000003.rejected-1").mkdir()
    assert main(["checkpoints", str(ck), "--verify"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "step-00000001" in out and "✓" in out
    assert "step-00000002" in out and "offset" in out
    assert "step-5" in out and "not a checkpoint directory name" in out
    assert "step-00000003.rejected-1" in out and "quarantined" in out


flags = st.sampled_from(["--mtbf-h", "--gpus", "--gpu-mtbf-h", "--write-s", "--restart-s", "--segments",
                         "--seed", "--tolerance", "--bogus", "-h"])  # fmt: skip
values = st.one_of(
    st.sampled_from(["-1", "0", "1e308", "inf", "nan", "two", "", "1e-300", "3", "0.5", "10000000000"]),
    st.integers(-(10**12), 10**12).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=6),
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(argv=st.lists(st.tuples(flags, values), max_size=6))
def test_fuzz_plan_flags(argv: list[tuple[str, str]]) -> None:
    """Random flags and values: a result, a verdict, or a usage error; never a traceback."""
    import contextlib
    import io

    from resilient.cli import main

    args = ["plan", *[x for pair in argv for x in pair]]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(args)
        except SystemExit as e:
            rc = e.code
    assert rc in (0, 1, 2), (args, rc)
    assert "Traceback" not in err.getvalue()


config_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)  # fmt: skip


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_config_values(tmp_path: Path, data: st.DataObject) -> None:
    """Random values for real config keys: a Config, or a ConfigError naming the key; nothing else."""
    import yaml

    from resilient.config import Config, load_config
    from resilient.errors import ConfigError

    def keys(model: Any, prefix: str = "") -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                out += keys(sub, f"{prefix}{name}.")
            else:
                out.append(prefix + name)
        return out

    doc: dict[str, Any] = {}
    for key in data.draw(st.lists(st.sampled_from(keys(Config)), min_size=1, max_size=4)):
        node = doc
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = data.draw(config_values)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        load_config(path)
    except ConfigError as e:
        assert str(path) in str(e) or "c.yaml" in str(e), e


# -- records and payloads from peers ------------------------------------------------------------------
def test_a_malformed_fault_record_is_a_fault_of_its_own_not_a_dead_listener() -> None:
    import torch.distributed as dist

    from resilient.runtime.coordination.coordinator import Coordinator
    from resilient.runtime.faults.records import FaultRecord, MalformedRecord, Symptom

    with pytest.raises(MalformedRecord, match=r"rank='zero'"):
        FaultRecord.from_json(
            json.dumps({**FaultRecord(0, 0, 1, "exception", "soft", "s", "m").__dict__, "rank": "zero"})
        )
    store = dist.HashStore()
    co = Coordinator(store, "ns", 0, 2, 1.0)
    store.set(co.key(3, "fault"), b"\xff{not json")
    got = co.wait_fault(3, store)  # (the listener thread's call: it must return, not raise)
    assert got is not None and got.kind == Symptom.MALFORMED.value and got.severity == "soft"
    assert "malformed fault record (not JSON" in got.message


def test_a_malformed_barrier_payload_fails_every_rank_alike_naming_it() -> None:
    import torch.distributed as dist

    from resilient.errors import CoordinationError
    from resilient.runtime.coordination.agreement import RestorePlan, restore_plan
    from tests.unit.test_coordinator import Concurrently, ranks

    c = ranks(3, store=dist.HashStore())
    payloads = ["[4, 3]", '{"x": 1}', "[4, 3]"]  # rank 1's snapshot list is not a list of steps

    def recover(co: Any) -> int:
        return RestorePlan.parse(co._barrier(0, "recover", payloads[co.rank], restore_plan)).restore_step()

    run = Concurrently(*[lambda co=co: recover(co) for co in c]).join()
    for e in run.errors:
        assert isinstance(e, CoordinationError) and "ranks [1] posted malformed snapshot lists" in str(e), e


def test_a_malformed_node_block_aborts_the_barrier_for_every_rank() -> None:
    import torch.distributed as dist

    from resilient.errors import PeerAborted
    from resilient.runtime.coordination.coordinator import Coordinator
    from tests.unit.test_coordinator import Concurrently

    store = dist.HashStore()
    c = [Coordinator(store, "ns", r, 3, 2.0, blocks=True) for r in range(3)]
    base = c[0].key(0, "v")
    store.set(f"{base}/b/2", "not json")  # a block someone else wrote for rank 2
    store.append(f"{base}/blocks", "2,")
    store.add(f"{base}/count", 1)
    run = Concurrently(*[lambda co=co: co.agree(0, "v", "1", "all") for co in c[:2]]).join()
    for e in run.errors:
        assert isinstance(e, PeerAborted) and "malformed payload" in str(e), e


def test_a_malformed_store_replica_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    import torch.distributed as dist

    from resilient.runtime.keeping.resume import StoreCopy

    store = dist.HashStore()
    rep = StoreCopy(store, "rep", 0, 1 << 20)
    rep.publish(5, 2, {"rng": {"t": torch.arange(4)}})
    assert rep.fetch(0, 5) is not None
    head = json.dumps(
        {"step": 5, "world": 2, "skeleton": {"T": 0}, "layout": [["float32", [10**12], 0, 4 * 10**12]]}
    )
    store.set(rep.key(1, 5), head.encode() + b"\n" + b"\x00" * 16)
    assert rep.fetch(1, 5) is None  # (never an allocation of 4 TB)


def test_a_malformed_shared_memory_slot_is_skipped_and_the_other_used(tmp_path: Path) -> None:
    from resilient.checkpoint.shm import ShmSnapshot

    shm = ShmSnapshot("job", 0, base=tmp_path)
    shm.capture(4, {"x": torch.arange(8.0)}, owner=(0, 1))
    shm.capture(5, {"x": torch.arange(8.0) + 1}, owner=(0, 1))
    newest = max((0, 1), key=lambda i: json.loads((shm.dir / f"slot{i}.json").read_text())["step"])
    meta = json.loads((shm.dir / f"slot{newest}.json").read_text())
    meta["layout"][0][2] = [10**12]
    (shm.dir / f"slot{newest}.json").write_text(json.dumps(meta))
    assert shm.steps() == [4]
    step, state = shm.load()  # type: ignore[misc]
    assert step == 4 and torch.equal(state["x"], torch.arange(8.0))


launch_flags = st.sampled_from(["--nproc-per-node", "--nnodes", "--heartbeat-timeout", "--startup-timeout",
                                "--backoff-initial", "--backoff-max", "--restart-window", "--max-repeats",
                                "--max-health-failures", "--standby", "--metrics-port", "--metrics-linger",
                                "--replace", "--max-restarts"])  # fmt: skip


@settings(max_examples=EXAMPLES, deadline=None)
@given(argv=st.lists(st.tuples(launch_flags, values), max_size=5))
def test_fuzz_launch_flags(argv: list[tuple[str, str]]) -> None:
    """`resilient launch`'s command line, parsed as its main parses it (nothing is started):
    accepted, or a usage error (exit 2); never a traceback."""
    import contextlib
    import io

    from resilient.launcher.cli import parse

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parse([*[x for pair in argv for x in pair], "train.py"])
        except SystemExit as e:
            assert e.code == 2, (argv, e.code)
    assert "Traceback" not in err.getvalue()
