"""The tree walks on the step's hot path, timed on a small transformer's model + AdamW state.

Every snapshot step runs ``Registry.capture`` (with ``to_portable``'s walk once DTensor is imported,
as DCP and FSDP2 do) and ``SnapshotRing.capture`` (a walk that copies each tensor leaf into its
reused buffer); a checkpoint's ``save`` blocks for ``encode``'s walk too. The model has many small
tensors, the case where a walk's own Python overhead weighs the most against the copies.

Two walks that only name each leaf by its path, one written by hand (as every walk was before
``resilient.state.tree``) and one through ``tree.map_with_path``, give the utility's own cost.

``--against OLD/resilient/state/snapshot.py`` (e.g. from ``git archive <rev> resilient``) times
this ``SnapshotRing.capture`` against that one in one process instead: four rings, two of each,
in a shuffled order every call, CPU time of the thread, so that neither a busy neighbour nor
memory placement favours one side. Passing this tree's own ``snapshot.py`` is the control (it
shows the method's noise).

    OMP_NUM_THREADS=1 python benchmarks/state_walks.py [--layers 12] [--repeat 200] [--rounds 5]
    OMP_NUM_THREADS=1 python benchmarks/state_walks.py --against /tmp/old/resilient/state/snapshot.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.tensor  # (what DCP/FSDP2 import: it makes to_portable walk)

import resilient
from resilient.checkpoint.codec import encode
from resilient.state import Registry, SnapshotRing
from resilient.state.dtensor import holds_dtensors, to_portable
from resilient.state.snapshot import Frozen


def make_state(layers: int, width: int) -> tuple[Registry, int]:
    """A registry tracking a small transformer and its AdamW (one step taken: moments exist)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 4, 2 * width, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(1000, width),
        torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        torch.nn.Linear(width, 1000),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 1000, (2, 16))).sum().backward()
    opt.step()
    reg = Registry()
    reg.add("model", model)
    reg.add("optim", opt)
    return reg, sum(1 for _ in _tensors(reg.capture()))


def _tensors(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _tensors(v)


def by_hand(tree: Any) -> Any:
    """The shape of ``SnapshotRing.capture``'s walk before the tree utility, with a trivial leaf."""

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return path
        if isinstance(obj, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        return obj

    return walk(tree, "")


def through_tree(tree: Any) -> Any:
    from resilient.state.tree import map_with_path

    return map_with_path(lambda obj, path: obj, tree, typed=(torch.Tensor, lambda obj, path: path))


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # buffers allocated, caches warm
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def against(path: Path, state: dict[str, Any], calls: int) -> dict[str, Any]:
    """``SnapshotRing.capture`` here vs the one in ``path``, interleaved (see the module's doc)."""
    spec = importlib.util.spec_from_file_location("snapshot_against", path)
    assert spec is not None and spec.loader is not None
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other  # (its dataclasses look their module up)
    spec.loader.exec_module(other)
    # the RNG leaves wrapped in the other module's Frozen, so that it keeps them by reference too
    theirs = {k: {n: other.Frozen(v.value) if isinstance(v, Frozen) else v for n, v in s.items()}
              if k == "__rng__" else s for k, s in state.items()}  # fmt: skip
    rings = [("against", other.SnapshotRing(), theirs), ("this", SnapshotRing(), state)]
    rings += [(name, type(ring)(), st) for name, ring, st in reversed(rings)]
    step = iter(range(1 << 30))
    rng = random.Random(0)
    times: dict[str, list[float]] = {"against": [], "this": []}
    for i in range(calls + 20):
        got = dict.fromkeys(times, 0.0)
        for name, ring, st in rng.sample(rings, len(rings)):
            t0 = time.thread_time()
            ring.capture(next(step), st)
            got[name] += (time.thread_time() - t0) / 2
        if i >= 20:  # (the first calls allocate the buffers)
            for name in times:
                times[name].append(got[name])
    diff = [a - b for a, b in zip(times["this"], times["against"], strict=True)]
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    return {
        "against": str(path),
        "capture_cpu_ms": {name: round(v, 4) for name, v in med.items()},
        "paired_diff_us": round(statistics.median(diff) * 1e6, 1),
        "paired_diff_pct": round(statistics.median(diff) * 1e3 / med["against"] * 100, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=200, help="timed calls per measurement (median)")
    ap.add_argument("--rounds", type=int, default=5, help="measurements (the median of their medians)")
    ap.add_argument("--no-tree", action="store_true", help="skip the walk through resilient.state.tree")
    ap.add_argument("--against", type=Path, help="another version's resilient/state/snapshot.py")
    ap.add_argument("--calls", type=int, default=800, help="--against: interleaved calls")
    args = ap.parse_args()
    reg, leaves = make_state(args.layers, args.width)
    if args.against is not None:
        result = against(args.against, reg.capture(), args.calls)
        print(json.dumps({"tensor_leaves": leaves, **result}, indent=1))
        return
    ring = SnapshotRing()
    state = reg.capture()
    step = iter(range(1 << 30))
    cases: dict[str, Callable[[], Any]] = {
        "ring.capture": lambda: ring.capture(next(step), state),
        "registry.capture+ring.capture": lambda: ring.capture(next(step), reg.capture()),
        "to_portable": lambda: to_portable(state),
        "encode": lambda: encode(state),
        "materialize": lambda: ring.materialize(ring.steps()[0]),
        "holds_dtensors": lambda: holds_dtensors(state),
        "walk: by hand": lambda: by_hand(state),
    }
    if not args.no_tree:
        cases["walk: tree.map_with_path"] = lambda: through_tree(state)
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):  # interleaved, so a busy neighbour slows every case alike
        for name, fn in cases.items():
            rounds[name].append(median_ms(fn, args.repeat))
    out = {
        "resilient": resilient.__file__,
        "tensor_leaves": leaves,
        "median_ms": {name: round(statistics.median(v), 4) for name, v in rounds.items()},
        "spread_ms": {name: [round(min(v), 4), round(max(v), 4)] for name, v in rounds.items()},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
