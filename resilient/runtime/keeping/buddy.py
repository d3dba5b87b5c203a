"""A buddy copy: each rank's newest shared-memory snapshot, also held by a rank on another node, so
that a lost node's sharded state (an FSDP2 shard, a pipeline stage) survives it in memory.

Under ``resilient launch`` with more than one node, rank ``r`` sends each snapshot it mirrors to
its *buddy*, the same local rank on the next node (``(r + local_world_size) % world_size``), in a
background thread: the slot's bytes as the shared-memory mirror wrote them, copied by the kernel
(``sendfile``), read like a seqlock (its description before and after the bytes must be the
same), and their hash (xxh3). The buddy's server thread reads them straight into its own node's
shared memory, two slots alternating like the mirror's, and describes a slot, with the sender's
hash, only once every byte arrived whole; the hash is checked whenever the copy is read. A send
still in flight when a newer snapshot is due is not queued behind (the newest wins). Every rank
restores one of the two newest snapshots, so a mirror about to overwrite its older slot first
waits until the newer one reached the buddy (bounded by ``WAIT_S``): the buddy's copy is never
more than one snapshot behind, and nothing of this is on the step's critical path unless the
link is slower than the snapshots (then the wait is part of the mirror's measured cost, which
``snapshot.interval: auto`` keeps within its budget).

A rank whose buddy holds an equal copy of its state already (data-parallel replicas: every large
object's fingerprint posted to the store copy equals the buddy's of the same step) sends nothing.

At a recovery each survivor offers the steps of the copies it holds (:meth:`Buddy.held`); the
plan names, for a replacement whose state no replica holds, the survivor holding its
predecessor's copy of the step every rank restores (``agreement.stored_donors``). The
replacement reads it from that survivor's server (:func:`fetch`), checks the hash, each tensor's
byte sum, and each large object's fingerprint against the one its predecessor posted to the store
copy for that step: a copy that cannot be vouched for is never loaded.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
import xxhash
from loguru import logger

from resilient.checkpoint.codec import check_layout, decode, dtype_from_name
from resilient.checkpoint.manifest import write_json_durable
from resilient.checkpoint.shm import ShmSnapshot, verify_sums
from resilient.errors import CheckpointError, StateRestoreError
from resilient.runtime.keeping.resume import StoreCopy, fingerprint

CHUNK = 8 << 20  # bytes per socket write and hash update
WAIT_S = 5.0  # the longest a mirror waits for the send of the slot it is about to overwrite
TIMEOUT_S = 30.0  # a peer that stops reading or writing for this long is given up


def prefix(run_id: str) -> str:
    """Where in the job's store the buddy servers post their addresses."""
    return f"resilient/{run_id}/buddy"


def buddy_of(rank: int, world: int, local_world: int) -> int | None:
    """The rank holding ``rank``'s copy: the same local rank on the next node (None: one node)."""
    if local_world < 1 or world <= local_world:
        return None
    return (rank + local_world) % world


def _line(f: BinaryIO) -> dict[str, Any]:
    raw = f.readline(1 << 20)
    if not raw.endswith(b"\n"):
        raise CheckpointError("buddy copy: the connection closed mid-message")
    got = json.loads(raw)
    if not isinstance(got, dict):
        raise CheckpointError(f"buddy copy: {raw[:80]!r} is not a message")
    return dict(got)


def _send_line(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


class Buddy:
    """This rank's side of the buddy copy: the server holding another rank's copies, and the
    sender of its own (see the module docstring). ``store``: a connection of its own (the sender
    runs in its thread); ``copies``: the store copy read on it."""

    def __init__(
        self,
        shm: ShmSnapshot,
        rank: int,
        world: int,
        local_world: int,
        store: dist.Store,
        run_id: str,
        copies: StoreCopy,
        host: str,
    ) -> None:
        self.shm, self.rank, self.world = shm, rank, world
        self.to = buddy_of(rank, world, local_world)
        self.store, self.prefix, self.copies = store, prefix(run_id), copies
        self.held_dir = shm.top / "buddy"
        # a copy this process's predecessor received is not vouched for by anything this one saw
        frm = (rank - local_world) % world
        shutil.rmtree(self.held_dir / f"rank{frm:05d}", ignore_errors=True)
        self.replica: bool | None = None  # the buddy holds an equal copy itself (nothing to send)
        self.sent = 0  # copies the buddy acknowledged
        self.sent_bytes = 0
        self.send_s = 0.0  # their time in the sender thread
        self.waited_s = 0.0  # the mirror's waits for a send (on the step's critical path)
        self.acked = -1  # the newest step the buddy acknowledged
        self._stalled = False  # a wait for the send in flight ran out: the next captures go on
        self._want: int | None = None
        self._streaming: int | None = None
        self._closed = False
        self._cv = threading.Condition()
        self._listener = socket.create_server(("", 0))
        port = int(self._listener.getsockname()[1])
        store.set(f"{self.prefix}/addr/{rank}", f"{host}:{port}")
        threading.Thread(target=self._serve, name="resilient-buddy-server", daemon=True).start()
        threading.Thread(target=self._send_loop, name="resilient-buddy-sender", daemon=True).start()

    # -- the sender ---------------------------------------------------------------------------------
    def send(self, step: int) -> None:
        """The mirror just wrote ``step``: it goes to the buddy once the send in flight is done."""
        if self.to is None or self.replica:
            return
        with self._cv:
            self._want = step
            self._cv.notify_all()

    def summary(self) -> dict[str, Any]:
        """What the copy cost this rank (``run_finished``'s ``buddy``)."""
        return {
            "to": self.to,
            "replica": self.replica,
            "sent": self.sent,
            "bytes_per_copy": self.sent_bytes // self.sent if self.sent else 0,
            "send_s_per_copy": self.send_s / self.sent if self.sent else None,
            "waited_s": self.waited_s,
        }

    def settled(self, timeout: float) -> bool:
        """Whether every send asked for ended (sent, refused or given up) within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._want is not None or self._streaming is not None:
                if time.monotonic() >= deadline:
                    return False
                self._cv.wait(deadline - time.monotonic())
        return True

    def before_capture(self, newest: int) -> None:
        """The mirror is about to overwrite its older slot, leaving ``newest`` and the new one:
        every rank restores one of those two, so ``newest`` must have reached the buddy first.
        Waits while it is still on its way (bounded: a link slower than the snapshots shows here,
        on the step's critical path, and in the mirror's measured cost)."""
        t0 = time.monotonic()
        deadline = t0 + WAIT_S
        with self._cv:
            # (a send that outlived one wait is not waited for again until a send ends)
            while (
                not self._stalled
                and self.acked < newest
                and (self._want is not None or self._streaming is not None)
            ):
                if time.monotonic() >= deadline:
                    self._stalled = True
                    break
                self._cv.wait(deadline - time.monotonic())
        self.waited_s += time.monotonic() - t0

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                while self._want is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                step = self._want
                assert step is not None  # (the wait ended: a step is wanted)
                self._want, self._streaming = None, step
            t0 = time.monotonic()
            try:
                if self._decide(step) is not True and self._send_slot(step):
                    self.sent += 1
                    self.send_s += time.monotonic() - t0
                    self.acked = step
            except Exception as e:  # (a second line of defence: the checkpoint is the first)
                logger.debug("rank {}: buddy copy of step {} not sent: {}", self.rank, step, e)
            finally:
                with self._cv:
                    self._streaming, self._stalled = None, False
                    self._cv.notify_all()

    def _decide(self, step: int) -> bool | None:
        """Whether the buddy already holds an equal copy of every large object (None: unknown yet)."""
        if self.replica is None and self.to is not None:
            mine = self.copies.read(self.rank, step)
            theirs = self.copies.read(self.to, step)
            if mine is not None and theirs is not None and step > 0:
                self.replica = mine[1] == theirs[1]
        return self.replica

    def _slot(self, step: int) -> tuple[int, bytes, dict[str, Any]] | None:
        """(slot index, description as read, parsed) of this rank's mirror of ``step``."""
        for i in (0, 1):
            with contextlib.suppress(OSError, ValueError):
                raw = (self.shm.dir / f"slot{i}.json").read_bytes()
                meta = json.loads(raw)
                if meta.get("step") == step and meta.get("rank") == self.rank:
                    return i, raw, meta
        return None

    def _send_slot(self, step: int) -> bool:
        found = self._slot(step)
        if found is None:
            return False  # (overwritten already: a newer one is on its way)
        i, raw, meta = found
        size = int(meta["size"])
        with socket.create_connection(address(self.store, self.prefix, self.to), TIMEOUT_S) as sock:  # type: ignore[arg-type]
            _send_line(sock, {"op": "put", "rank": self.rank, "meta": meta})
            with open(self.shm.dir / f"slot{i}.bin", "rb") as f:
                if size:
                    sock.sendfile(f, 0, size)  # (the kernel copies: no pass through Python)
                    with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
                        digest = xxhash.xxh3_128_hexdigest(mm)
                else:
                    digest = xxhash.xxh3_128_hexdigest(b"")
            whole = False  # (the description gone or rewritten: the slot changed as it went)
            with contextlib.suppress(OSError):
                whole = (self.shm.dir / f"slot{i}.json").read_bytes() == raw
            _send_line(sock, {"ok": whole, "xxh3": digest})
            reply = _line(sock.makefile("rb"))
        if reply.get("ok"):
            self.sent_bytes += size
        return bool(reply.get("ok"))

    # -- the holder ---------------------------------------------------------------------------------
    def held(self) -> dict[str, list[int]]:
        """{rank: steps} of the complete copies this rank holds for others, at this world size."""
        out: dict[str, list[int]] = {}
        for d in sorted(self.held_dir.glob("rank[0-9]*")):
            for m in ShmSnapshot.at(d).slots():
                if m["world"] == self.world and m["rank"] is not None:
                    out.setdefault(str(m["rank"]), []).append(int(m["step"]))
        return out

    def drop_after(self, step: int) -> None:
        """The ranks rolled back to ``step``: later copies are never restored."""
        for d in self.held_dir.glob("rank[0-9]*"):
            ShmSnapshot.at(d).drop_after(step)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # (closed)
            threading.Thread(
                target=self._handle, args=(conn,), name="resilient-buddy-peer", daemon=True
            ).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(TIMEOUT_S)
            f = conn.makefile("rb")
            try:
                msg = _line(f)
                if msg.get("op") == "put":
                    ok = self._receive(f, int(msg["rank"]), msg["meta"])
                    _send_line(conn, {"ok": ok})
                elif msg.get("op") == "get":
                    self._serve_copy(conn, int(msg["rank"]), int(msg["step"]))
            except Exception as e:  # (a peer's garbage or its death: nothing described)
                logger.debug("rank {}: buddy connection ended: {}", self.rank, e)

    def _receive(self, f: BinaryIO, src: int, meta: dict[str, Any]) -> bool:
        """A copy's bytes into the slot not holding the newest complete copy; described last."""
        size = int(meta["size"])
        check_layout(meta.get("layout"), size, f"buddy copy of rank {src}", keyed=True)
        d = self.held_dir / f"rank{src:05d}"
        d.mkdir(parents=True, exist_ok=True)
        i = _older_slot(d)
        (d / f"slot{i}.json").unlink(missing_ok=True)
        with open(d / f"slot{i}.bin", "wb+") as out:
            out.truncate(size)
            if size:  # (straight into the slot's pages: one copy, by the kernel)
                with mmap.mmap(out.fileno(), size) as mm, memoryview(mm) as view:
                    got = 0
                    while got < size:
                        n = f.readinto(view[got : got + CHUNK])  # type: ignore[attr-defined]
                        if not n:
                            raise CheckpointError(f"buddy copy of rank {src}: the connection closed mid-copy")
                        got += n
        trailer = _line(f)
        digest = trailer.get("xxh3")
        if not trailer.get("ok") or not isinstance(digest, str):
            return False  # (its slot was overwritten as it went)
        # the sender's hash of the bytes, checked against what is read whenever the copy is used
        write_json_durable(d / f"slot{i}.json", {**meta, "xxh3": digest}, durable=False)
        return True

    def _serve_copy(self, conn: socket.socket, src: int, step: int) -> None:
        d = self.held_dir / f"rank{src:05d}"
        for i in (0, 1):
            with contextlib.suppress(OSError, ValueError):
                meta = json.loads((d / f"slot{i}.json").read_bytes())
                if meta.get("step") == step:
                    _send_line(conn, {"meta": meta})
                    with open(d / f"slot{i}.bin", "rb") as f:
                        conn.sendfile(f, 0, int(meta["size"]))
                    return
        _send_line(conn, {"error": f"rank {self.rank} holds no copy of rank {src}'s step {step}"})

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        with contextlib.suppress(OSError):
            self._listener.close()


def _older_slot(d: Path) -> int:
    """The slot a new copy goes to: an undescribed one, else the one holding the older step."""
    steps = []
    for i in (0, 1):
        try:
            steps.append(int(json.loads((d / f"slot{i}.json").read_bytes())["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            return i
    return 0 if steps[0] <= steps[1] else 1


def address(store: dist.Store, at: str, rank: int) -> tuple[str, int]:
    """Where rank ``rank``'s buddy server listens (posted under ``at`` when it started)."""
    host, _, port = store.get(f"{at}/addr/{rank}").decode().rpartition(":")
    return host, int(port)


def fetch(address: tuple[str, int], rank: int, step: int, prints: dict[str, str]) -> dict[str, Any]:
    """Rank ``rank``'s copy of ``step`` from the buddy at ``address``: its objects named in
    ``prints`` (each checked against the fingerprint its owner posted), else StateRestoreError."""
    where = f"buddy copy of rank {rank}, step {step} at {address[0]}:{address[1]}"
    try:
        with socket.create_connection(address, timeout=TIMEOUT_S) as sock:
            _send_line(sock, {"op": "get", "rank": rank, "step": step})
            f = sock.makefile("rb")
            head = _line(f)
            if "error" in head:
                raise StateRestoreError(f"{where}: {head['error']}")
            meta = head["meta"]
            buf = bytearray(int(meta["size"]))
            view = memoryview(buf)
            got = 0
            while got < len(buf):
                n = f.readinto(view[got:])
                if not n:
                    raise StateRestoreError(f"{where}: the connection closed mid-copy")
                got += n
    except OSError as e:
        raise StateRestoreError(f"{where}: {e}") from e
    if xxhash.xxh3_128_hexdigest(buf) != meta.get("xxh3"):
        raise StateRestoreError(f"{where}: checksum mismatch")
    tree = _decode(meta, view, where)
    out = {}
    for name, want in prints.items():
        if name not in tree or fingerprint(tree[name]) != want:
            raise StateRestoreError(f"{where}: {name!r} does not match the fingerprint its rank posted")
        out[name] = tree[name]
    return out


def _decode(meta: dict[str, Any], view: memoryview, where: str) -> dict[str, Any]:
    try:
        layout = check_layout(meta.get("layout"), int(meta["size"]), where, keyed=True)
    except CheckpointError as e:
        raise StateRestoreError(str(e)) from e
    tensors = []
    for dtype, shape, offset, nbytes in layout:
        t = torch.empty(shape, dtype=dtype_from_name(dtype))
        if nbytes:
            t.reshape(-1).view(torch.uint8).numpy()[:] = view[offset : offset + nbytes]
        tensors.append(t)
    try:
        verify_sums(meta, tensors, where)
    except CheckpointError as e:
        raise StateRestoreError(str(e)) from e
    tree = decode(meta["skeleton"], tensors)
    if not isinstance(tree, dict):
        raise StateRestoreError(f"{where}: not a dict of objects")
    return tree
