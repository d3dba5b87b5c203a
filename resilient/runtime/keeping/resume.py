"""Where a (re)started worker group takes its state from: memory (its own node's shared memory, a
peer's, the store's copy of small per-rank state), else the newest checkpoint.

After a relaunch by ``resilient launch`` every node's ``/dev/shm`` still holds the snapshots its
dead workers took (the agent keeps them), each labelled with the global rank and world size that
wrote it. New rank ``r`` takes the state of old rank ``r`` (the same index; under a smaller or
larger world too). For the newest step that is not older than the newest committed checkpoint,
each new rank's state comes from, in this order:

1. **shm**: its own node holds old rank ``r``'s snapshot (the common case: a worker relaunched on
   the same node). Nothing moves between processes.
2. **peer**: another rank holds old rank ``r``'s snapshot (the rendezvous renumbered the nodes):
   it sends it over the new process group.
3. **store copy + peer**: nobody holds it (the node was lost). Small objects (RNG states, data
   position, scheduler: up to ``snapshot.store_copy_max_bytes`` per rank) come from the store copy every
   rank posts to the job's store with each snapshot; large ones (model, optimizer) from a peer
   that holds an equal copy, as data-parallel training keeps them. With each store copy the rank
   posts a :func:`fingerprint` of every object too large for the store: a holder whose copy has
   the lost rank's own fingerprint sends it, and the receiver checks the fingerprint of what
   arrived. (Without a posted fingerprint, two holders with equal fingerprints vouch for each
   other.) Anything else (a sharded state, a per-rank object nobody holds) cannot be rebuilt from
   memory: the ranks fall back to the checkpoint on disk together (whose sharded format reshards).

Every rank computes the same plan from the same exchanged facts; the ranks vote at the end, and
if any failed to load, everyone falls back to the checkpoint path together.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from resilient.checkpoint.codec import check_layout, decode, dtype_from_name, encode
from resilient.checkpoint.shm import ShmSnapshot
from resilient.checkpoint.staging import extent, plan, typed_view
from resilient.errors import CheckpointError
from resilient.state.digest import tensor_sums

Exchange = Callable[[str, str], list[str]]


# ---- packing a subtree into one byte buffer (store copies and peer transfers) ------------------
def pack(tree: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    """(header, bytes): the JSON skeleton and layout of ``tree``, and its tensors in one buffer."""
    skeleton, leaves = encode(tree)
    slots = plan(leaves)
    buf = torch.zeros(extent(slots), dtype=torch.uint8)  # zeroed padding: equal state, equal bytes
    for leaf, slot in zip(leaves, slots, strict=True):
        typed_view(buf, slot).copy_(leaf.tensor)
    header = {"skeleton": skeleton, "layout": [[s.dtype, list(s.shape), s.offset, s.nbytes] for s in slots]}
    return header, buf


def unpack(
    header: dict[str, Any], buf: torch.Tensor | bytes | memoryview, where: str = "packed state"
) -> Any:
    """The tree :func:`pack` made (its layout checked against the buffer before any allocation)."""
    raw = buf.numpy().data if isinstance(buf, torch.Tensor) else memoryview(buf)
    if not isinstance(header, dict) or "skeleton" not in header:
        raise CheckpointError(f"{where}: header {str(header)[:80]} has no skeleton")
    tensors = []
    for dtype, shape, offset, nbytes in check_layout(header.get("layout"), len(raw), where):
        t = torch.empty(shape, dtype=dtype_from_name(dtype))  # owns its memory
        if nbytes:
            t.reshape(-1).view(torch.uint8).numpy()[:] = raw[offset : offset + nbytes]
        tensors.append(t)
    return decode(header["skeleton"], tensors)


def fingerprint(obj: Any) -> str:
    """A checksum of one object as held, taken where its tensors live and without a copy: its
    skeleton, and each tensor leaf's path, dtype, shape and exact byte sum
    (:func:`resilient.state.digest.tensor_sums`: a flipped bit changes it). Equal state has an
    equal fingerprint on any device, captured live or loaded from a shared-memory slot."""
    skeleton, leaves = encode(obj)
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(skeleton, sort_keys=True).encode())
    for leaf, total in zip(leaves, tensor_sums([leaf.tensor for leaf in leaves]), strict=True):
        t = leaf.tensor
        h.update(f"\n{leaf.key}|{t.dtype}|{tuple(t.shape)}|{total}".encode())
    return h.hexdigest()


# ---- moving a packed subtree between two ranks ---------------------------------------------------
def send_tree(tree: dict[str, Any] | None, dst: int, group: Any = None, device: str = "cpu") -> None:
    """Send ``tree`` to rank ``dst`` (``None``: this rank has nothing to send, and says so, so
    that the receiver does not wait for bytes that will never come). ``device``: where the
    group's backend takes its tensors from (``cuda`` for NCCL)."""
    if tree is None:
        dist.send(torch.tensor([-1, 0], dtype=torch.int64, device=device), dst, group=group)
        return
    header, buf = pack(tree)
    head = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    dist.send(torch.tensor([head.numel(), buf.numel()], dtype=torch.int64, device=device), dst, group=group)
    dist.send(head.to(device), dst, group=group)
    if buf.numel():
        dist.send(buf.to(device), dst, group=group)


def recv_tree(src: int, group: Any = None, device: str = "cpu") -> dict[str, Any]:
    """What :func:`send_tree` on rank ``src`` sent (its layout checked before it is unpacked)."""
    sizes = torch.empty(2, dtype=torch.int64, device=device)
    dist.recv(sizes, src, group=group)
    n_head, n_buf = (int(x) for x in sizes)
    if n_head < 0:
        raise CheckpointError(f"rank {src} could not load the state it was to send")
    head = torch.empty(n_head, dtype=torch.uint8, device=device)
    dist.recv(head, src, group=group)
    buf = torch.empty(n_buf, dtype=torch.uint8, device=device)
    if n_buf:
        dist.recv(buf, src, group=group)
    return dict(unpack(json.loads(head.cpu().numpy().tobytes()), buf.cpu()))


# ---- the store copy of small per-rank state ---------------------------------------------------
class StoreCopy:
    """Each snapshot's small objects, posted by every rank to the job's store (which the launcher's
    rendezvous keeps alive across relaunches): a lost node's RNG and data position survive it."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, max_bytes: int) -> None:
        self.store, self.prefix, self.rank, self.max_bytes = store, prefix, rank, max_bytes
        # this rank's index as this process last wrote it (only it writes it): no store request
        # to read it back at each post, nor in a recovery's roll-back
        self._index: list[int] | None = None

    def own_steps(self) -> list[int]:
        if self._index is None:  # (a predecessor's, for a relaunched or replacement worker)
            index = f"{self.prefix}/r{self.rank}/index"
            self._index = json.loads(self.store.get(index)) if self.store.check([index]) else []
        return self._index

    def key(self, rank: int, step: int) -> str:
        return f"{self.prefix}/r{rank}/s{step}"

    def publish(self, step: int, world: int, state: dict[str, Any]) -> None:
        if self.max_bytes <= 0:
            return
        small: dict[str, Any] = {}
        prints: dict[str, str] = {}  # what did not fit: a peer's equal copy stands in for it
        budget = self.max_bytes
        for name in sorted(state):
            _, leaves = encode(state[name])
            n = sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in leaves)
            if n <= budget:
                small[name], budget = state[name], budget - n
            elif world > 1:  # (alone, a lost rank has no peer to take its state from)
                prints[name] = fingerprint(state[name])
        header, buf = pack(small)
        head = {"step": step, "world": world, "fingerprints": prints, **header}
        blob = json.dumps(head).encode() + b"\n" + buf.numpy().tobytes()
        self.store.set(self.key(self.rank, step), blob)  # type: ignore[arg-type]  # bytes work
        old = self.own_steps()
        keep = sorted({*old, step})[-2:]  # the two newest, like the shared-memory slots
        self._index = None  # (unknown until the write succeeds)
        self.store.set(f"{self.prefix}/r{self.rank}/index", json.dumps(keep))
        self._index = keep
        for s in set(old) - set(keep):
            self.store.delete_key(self.key(self.rank, s))

    def drop_after(self, step: int) -> None:
        """Forget this rank's posts of steps after ``step`` (see ``ShmSnapshot.drop_after``)."""
        if self.max_bytes <= 0:
            return
        old = self.own_steps()
        keep = [s for s in old if s <= step]
        if keep != old:
            self._index = None
            self.store.set(f"{self.prefix}/r{self.rank}/index", json.dumps(keep))
            self._index = keep
            for s in set(old) - set(keep):
                self.store.delete_key(self.key(self.rank, s))

    def fetch(self, rank: int, step: int) -> tuple[list[str], Any] | None:
        got = self.read(rank, step)
        return (sorted(got[0]), got[0]) if got is not None else None

    def read(self, rank: int, step: int) -> tuple[dict[str, Any], dict[str, str]] | None:
        """(the small objects, the fingerprints of the others) rank ``rank`` posted for ``step``."""
        key = self.key(rank, step)
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        head, _, body = raw.partition(b"\n")
        where = f"store copy of rank {rank}, step {step}"
        try:
            header = json.loads(head)
            tree = unpack(header, body, where)
            prints = header.get("fingerprints", {})
            if not isinstance(tree, dict):
                raise CheckpointError(f"{where}: not a dict of objects")
            if not isinstance(prints, dict) or not all(isinstance(v, str) for v in prints.values()):
                raise CheckpointError(f"{where}: malformed fingerprints")
        except (CheckpointError, ValueError, RecursionError) as e:  # (a peer's garbage: no store copy)
            logger.warning(f"rank {self.rank}: ignoring a malformed store copy: {e}")
            return None
        return tree, prints

    def names(self, rank: int, step: int) -> list[str]:
        got = self.fetch(rank, step)
        return got[0] if got is not None else []

    def fingerprints(self, rank: int, step: int) -> dict[str, str]:
        """The fingerprints rank ``rank`` posted for ``step`` of its objects too large to post."""
        got = self.read(rank, step)
        return got[1] if got is not None else {}


# ---- the plan ------------------------------------------------------------------------------------
@dataclass
class Restored:
    step: int
    state: dict[str, Any]
    # "shm" (every rank from its own node), "peer" (some state moved between ranks) or "flushed"
    # (some ranks from their snapshots an agent flushed to disk, the others from their own node)
    source: str
    world_from: int
    sources: dict[str, str] = field(default_factory=dict)  # object -> shm | peer:<rank> | store


@dataclass
class _Plan:
    step: int
    world_from: int
    owners: dict[int, int]  # new rank -> new rank holding old rank r's snapshot
    store_copy: dict[int, list[str]] = field(default_factory=dict)  # orphan rank -> names from the store
    donated: dict[str, dict[int, int]] = field(default_factory=dict)  # object -> {orphan: donor rank}
    prints: dict[int, dict[str, str]] = field(default_factory=dict)  # orphan -> its posted fingerprints
    flushed: list[int] = field(default_factory=list)  # ranks that read old rank r's flushed copy on disk


def _owner_of(held: list[list[dict[str, Any]]], step: int, old_rank: int, world_from: int) -> int | None:
    want = (step, old_rank, world_from)
    found = [
        p for p, slots in enumerate(held) if any((m["step"], m["rank"], m["world"]) == want for m in slots)
    ]
    if not found:
        return None
    return old_rank if old_rank in found else found[0]


@dataclass
class _Resume:
    shm: ShmSnapshot
    rank: int
    world: int
    names: list[str]
    exchange: Exchange
    store_copy: StoreCopy | None
    flushed: Callable[[int], ShmSnapshot] | None = None  # old rank r's snapshots its agent flushed
    _loaded: dict[int, dict[str, Any] | None] = field(default_factory=dict)
    _group: Any = None

    def run(self, newest_checkpoint: int) -> Restored | None:
        mine = {"shm": self.shm.slots(), "flushed": self._flushed_slots()}
        got = [json.loads(v) for v in self.exchange("resume_slots", json.dumps(mine))]
        held = [g["shm"] for g in got]
        disk = [g["flushed"] for g in got]  # [r]: old rank r's flushed snapshots, as new rank r sees them
        every = [m for slots in (*held, *disk) for m in slots]
        steps = sorted({int(m["step"]) for m in every}, reverse=True)
        for step in [s for s in steps if s >= newest_checkpoint]:
            worlds = {m["world"] for m in every if m["step"] == step}
            if len(worlds) != 1 or None in worlds:
                continue  # unlabelled, or two launches' snapshots of one step: not ours to mix
            sharded = any(m.get("sharded") for m in every if m["step"] == step)
            if sharded and worlds != {self.world}:
                logger.info(
                    f"step {step}: DTensor shards of {worlds.pop()} ranks, {self.world} now: from the "
                    "checkpoint, which reshards"
                )
                return None
            p = self._plan(step, int(worlds.pop()), held, disk)
            if p is not None:
                return self._execute(p)
        return None

    def _flushed_slots(self) -> list[dict[str, Any]]:
        """The snapshots of old rank ``self.rank`` that an agent flushed to disk, as this rank
        reads them (only this rank's own index: it is the one that would load them)."""
        if self.flushed is None:
            return []
        try:
            return [m for m in self.flushed(self.rank).slots() if m["rank"] == self.rank]
        except (OSError, CheckpointError) as e:
            logger.warning(f"rank {self.rank}: flushed snapshots not readable: {e}")
            return []

    def _from_disk(self, step: int) -> dict[str, Any]:
        """Old rank ``self.rank``'s flushed snapshot of ``step`` (its tensors' byte sums checked)."""
        assert self.flushed is not None
        got = self.flushed(self.rank).load(step)
        if got is None:
            raise CheckpointError(f"the flushed snapshot of step {step} is gone")
        return dict(got[1])

    def _local(self, step: int) -> dict[str, Any] | None:
        """This rank's own shared-memory snapshot of ``step`` (whichever old rank wrote it)."""
        if step not in self._loaded:
            got = None
            if step in self.shm.steps():
                try:
                    loaded = self.shm.load(step)
                    got = loaded[1] if loaded is not None else None
                except CheckpointError as e:
                    logger.warning(f"shared-memory snapshot of step {step} does not load: {e}")
            self._loaded[step] = got
        return self._loaded[step]

    def _plan(
        self, step: int, world_from: int, held: list[list[dict[str, Any]]], disk: list[list[dict[str, Any]]]
    ) -> _Plan | None:
        owners = {r: o for r in range(self.world) if (o := _owner_of(held, step, r, world_from)) is not None}
        # a rank no node holds in memory, whose agent flushed it: read back from disk by itself
        from_disk = [
            r
            for r in range(self.world)
            if r not in owners and _owner_of([disk[r]], step, r, world_from) is not None
        ]
        orphans = [r for r in range(self.world) if r not in owners and r not in from_disk]
        moves = any(o != r for r, o in owners.items())
        if (moves or orphans) and not dist.is_initialized():
            return None  # state would have to move between ranks, and there is no group to move it on
        p = _Plan(step, world_from, owners, flushed=from_disk)
        if not orphans:
            return p
        # Orphans (old rank lost with its node): small objects from the store copy, as rank 0
        # sees it (every rank plans alike); large ones from a holder of a verifiably equal copy.
        rep = self.store_copy
        view = {r: [rep.names(r, step), rep.fingerprints(r, step)] for r in orphans if rep is not None}
        agreed = json.loads(self.exchange(f"resume_replica_s{step}", json.dumps(view))[0])
        p.store_copy = {int(r): v[0] for r, v in agreed.items()}
        p.prints = {int(r): v[1] for r, v in agreed.items()}
        need = sorted({n for r in orphans for n in self.names if n not in p.store_copy.get(r, [])})
        mine: dict[str, str] = {}
        if need and any(m["step"] == step for m in held[self.rank]):
            local = self._local(step)
            mine = {n: fingerprint(local[n]) for n in need if local is not None and n in local}
        prints = [json.loads(v) for v in self.exchange(f"resume_digests_s{step}", json.dumps(mine))]
        for n in need:
            by = {q: d[n] for q, d in enumerate(prints) if n in d}
            for r in orphans:
                if n in p.store_copy.get(r, []):
                    continue
                want = p.prints.get(r, {}).get(n)
                if want is not None:  # the lost rank's own word for what it held
                    donors = [q for q, f in by.items() if f == want]
                elif len(by) >= 2 and len(set(by.values())) == 1:  # two equal copies vouch for each other
                    donors = list(by)
                else:
                    donors = []
                if not donors:
                    logger.info(
                        f"step {step}: {n!r} of lost rank {r} is not in the store copy and no "
                        f"holder's copy is verifiably equal to it ({len(by)} holder(s), "
                        f"{len(set(by.values()))} distinct, lost rank's fingerprint "
                        f"{'posted' if want else 'not posted'}): not restorable from memory"
                    )
                    return None
                p.donated.setdefault(n, {})[r] = r if r in donors else min(donors)
        return p

    # ---- moving state ---------------------------------------------------------------------------
    def _transfer_group(self) -> Any:
        if self._group is None:
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self._group

    def _send(self, tree: dict[str, Any] | None, dst: int) -> None:
        send_tree(tree, dst, self._transfer_group())

    def _recv(self, src: int) -> dict[str, Any]:
        return recv_tree(src, self._transfer_group())

    def _execute(self, p: _Plan) -> Restored | None:
        rank, step = self.rank, p.step
        state: dict[str, Any] = {}
        sources: dict[str, str] = {}
        ok = True
        try:
            for r in range(self.world):  # whole snapshots, in rank order on every rank
                o = p.owners.get(r)
                if o is None or rank not in (o, r):
                    continue
                if o == r:
                    local = self._local(step)
                    if local is None:
                        raise CheckpointError(f"own shared-memory snapshot of step {step} does not load")
                    state.update(local)
                    sources.update(dict.fromkeys(local, "shm"))
                elif rank == o:
                    self._send(self._local(step), r)
                else:
                    got = self._recv(o)
                    state.update(got)
                    sources.update(dict.fromkeys(got, f"peer:{o}"))
            if rank in p.flushed:
                got = self._from_disk(step)
                state.update(got)
                sources.update(dict.fromkeys(got, "flushed"))
            if rank not in p.owners and p.store_copy.get(rank):
                assert self.store_copy is not None
                fetched = self.store_copy.fetch(rank, step)
                if fetched is None:
                    raise CheckpointError(f"store copy of rank {rank}, step {step} is gone")
                state.update({n: fetched[1][n] for n in p.store_copy[rank]})
                sources.update(dict.fromkeys(p.store_copy[rank], "store"))
            self._donate(p, state, sources)
        except Exception as e:  # any failure: vote, then everyone goes to disk together
            logger.warning(f"restoring step {step} from memory failed on rank {rank}: {e}")
            ok = False
        votes = self.exchange(f"resume_ok_s{step}", "1" if ok else "0")
        if not all(v == "1" for v in votes):
            return None
        local_only = not p.store_copy and not p.donated and all(o == r for r, o in p.owners.items())
        if local_only and len(p.owners) == self.world:
            source = "shm"
        else:  # (some state moved between ranks, or came back from what an agent flushed)
            source = "flushed" if local_only and len(p.owners) + len(p.flushed) == self.world else "peer"
        return Restored(step, state, source, p.world_from, sources)

    def _donate(self, p: _Plan, state: dict[str, Any], sources: dict[str, str]) -> None:
        """The lost ranks' large objects, from the holders of verifiably equal copies the plan named:
        this rank sends those it donates, and takes those donated to it (their fingerprints checked)
        into ``state`` and ``sources``."""
        rank, step = self.rank, p.step
        for n, by_orphan in sorted(p.donated.items()):
            for r, donor in sorted(by_orphan.items()):
                if rank not in (r, donor):
                    continue
                local = self._local(step) if rank == donor else None
                if donor == r:  # the orphan holds an equal copy itself
                    got = {n: local[n]} if local is not None else {}
                elif rank == donor:
                    self._send({n: local[n]} if local is not None else None, r)
                    continue
                else:
                    got = self._recv(donor)
                want = p.prints.get(r, {}).get(n)
                if n not in got or (want is not None and fingerprint(got[n]) != want):
                    raise CheckpointError(
                        f"{n!r} from rank {donor} does not match the fingerprint lost rank {r} posted"
                    )
                state[n] = got[n]
                sources[n] = f"peer:{donor}" if donor != r else "shm"


def restore(*, newest_checkpoint: int, **how: Any) -> Restored | None:
    """The state this rank resumes from, or None (every rank then falls back to disk together).
    ``how``: shm, rank, world, names, exchange, store_copy (see :class:`_Resume`)."""
    return _Resume(**how).run(newest_checkpoint)
