"""FSDP2 state: what a durable checkpoint blocks the loop for, and what snapshots cost per step.

One run, 2 gloo ranks on CPU, side by side:
- checkpoint blocking: an FSDP2 model + AdamW (``--mb`` of state per rank). The copy limit (each
  rank's local shards copied once into buffers it reuses: the floor of any blocking save), the
  runtime's ``Checkpointer.save`` of the tracked state (local shards, as the runtime saves them;
  steady state: staging buffers reused) and ``dcp.async_save`` of ``get_state_dict`` (the time
  the caller is blocked; after a warm-up call). The copy and the runtime's save alternate, both
  ranks at once; minimum over ``--repeat`` of each per rank, the slower rank counted. Then the
  pipelined save (``checkpoint.pipelined``): the copy overlaps a forward/backward, and the
  optimizer step waits for it only if it is not done.
- snapshot cost: ``examples/train_fsdp2.py`` under the runtime with ``snapshot.interval: auto``;
  the runtime's own time per step (snapshots included, from ``run_finished``) against the mean
  step time.

    python benchmarks/fsdp2.py [--mb 256] [--repeat 8] [--out benchmarks/results/fsdp2.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rank_main(out: Path, mb: float, repeat: int) -> None:
    """One rank of the checkpoint comparison (started by run_ranks with env:// variables)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from resilient.checkpoint.codec import encode
    from resilient.checkpoint.manager import Checkpointer
    from resilient.state.dtensor import to_portable

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    width = 1024
    per_layer = width * width * 4 * 3 / world  # weight + two AdamW moments, this rank's shard
    layers = max(1, round(mb * 1e6 / per_layer))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()

    def tracked() -> dict[str, Any]:
        return {"model": to_portable(model.state_dict()), "optimizer": to_portable(opt.state_dict())}

    leaves = [leaf.tensor for leaf in encode(tracked())[1]]
    nbytes = sum(t.numel() * t.element_size() for t in leaves)
    buffers = [torch.empty_like(t) for t in leaves]
    copies, ours = [], []
    kw: dict[str, Any] = {"rank": rank, "world_size": world, "token": "bench", "keep": 1}
    with Checkpointer(out / "ours", incremental=False, **kw) as ck:
        for i in range(repeat + 1):  # the copy limit and a save, alternately, in the same conditions
            dist.barrier()
            t0 = time.perf_counter()
            for b, t in zip(buffers, leaves, strict=True):
                b.copy_(t)
            copies.append(time.perf_counter() - t0)
            dist.barrier()
            fut = ck.save(i + 1, tracked())
            if i:  # the first save allocates the staging buffers
                ours.append(ck.last_block_s)
            assert fut is not None
            fut.result()
        # pipelined (checkpoint.pipelined): the copy overlaps a forward/backward; the optimizer
        # step waits for it only if it is not done
        x = torch.randn(64, width)
        piped = []
        for i in range(repeat):
            dist.barrier()
            opt.zero_grad()
            ck.save(100 + i, tracked(), pipeline=[opt])
            model(x).sum().backward()
            opt.step()
            piped.append(ck.last_block_s)
            ck.wait()

    sd_model, sd_opt = get_state_dict(model, opt)
    state = {"model": sd_model, "optimizer": sd_opt}
    dcp.async_save(state, checkpoint_id=str(out / "dcp_warm")).result()
    dist.barrier()
    blocked = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(out / f"dcp{i}"))
        blocked.append(time.perf_counter() - t0)
        fut.result()
        dist.barrier()
    row = {"bytes": nbytes, "copy_s": min(copies), "ours_block_s": min(ours), "ours_pipelined_s": min(piped)}
    (out / f"rank{rank}.json").write_text(json.dumps({**row, "dcp_async_block_s": min(blocked)}))
    dist.destroy_process_group()


def checkpoint_blocking(mb: float, repeat: int) -> dict[str, Any]:
    from chaos.harness import run_ranks

    work = Path(tempfile.mkdtemp(prefix="resilient-fsdp2-bench-", dir=os.environ.get("BENCH_DIR")))
    try:
        me = str(Path(__file__).resolve())
        argv = [me, "--rank-main", str(work), "--mb", str(mb), "--repeat", str(repeat)]
        res = run_ranks(argv, 2, cwd=work, run_id="fsdp2-bench", timeout=1200)
        if not res.ok:
            raise SystemExit(res.describe())
        per = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = ("copy_s", "ours_block_s", "ours_pipelined_s", "dcp_async_block_s")
    row = {k: max(p[k] for p in per) for k in keys}
    row["mb_per_rank"] = per[0]["bytes"] / 1e6
    row["ours_over_copy"] = row["ours_block_s"] / row["copy_s"]
    row["ours_over_dcp_async"] = row["ours_block_s"] / row["dcp_async_block_s"]
    return row


def snapshot_cost(steps: int, dim: int, layers: int) -> dict[str, Any]:
    from chaos.harness import run_ranks
    from resilient.events import Event

    work = Path(tempfile.mkdtemp(prefix="resilient-fsdp2-snap-"))
    try:
        cfg = work / "steps.yaml"
        cfg.write_text("events:\n  steps: true\n")  # step_completed events: the step times
        argv = [str(ROOT / "examples" / "train_fsdp2.py"), "--steps", str(steps), "--dim", str(dim),
                "--layers", str(layers), "--config", str(cfg)]  # fmt: skip
        t0 = time.perf_counter()
        res = run_ranks(argv, 2, cwd=work, run_id="fsdp2-snap", timeout=1200)
        wall = time.perf_counter() - t0
        if not res.ok:
            raise SystemExit(res.describe())
        done = res.of(Event.RUN_FINISHED)
        steps_s = [e["step_s"] for e in res.of(Event.STEP_COMPLETED) if e.get("step_s") is not None]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    runtime_ms = max(e["runtime_ms_per_step"] for e in done)
    step_ms = 1e3 * (sum(steps_s) / len(steps_s)) if steps_s else 1e3 * wall / steps
    return {
        "steps": steps,
        "snapshots": max(e["snapshots"] for e in done),
        "snapshot_interval": max(e["snapshot_interval"] or 0 for e in done),
        "runtime_ms_per_step": runtime_ms,
        "step_ms": step_ms,
        "share_of_step": runtime_ms / step_ms,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=256.0, help="state per rank (model + AdamW moments)")
    p.add_argument("--repeat", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rank-main", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main is not None:
        _rank_main(args.rank_main, args.mb, args.repeat)
        return
    from chaos import results

    st = results.begin(repeat=args.repeat)
    ck = checkpoint_blocking(args.mb, args.repeat)
    print(f"checkpoint blocking, FSDP2 + AdamW, {ck['mb_per_rank']:.0f} MB per rank, 2 gloo ranks:")
    print(f"  copy limit        {ck['copy_s'] * 1e3:8.1f} ms")
    print(f"  resilient         {ck['ours_block_s'] * 1e3:8.1f} ms   ({ck['ours_over_copy']:.2f}x the limit)")
    print(f"  resilient, pipelined {ck['ours_pipelined_s'] * 1e3:5.1f} ms   (copy overlapped with fwd/bwd)")
    print(f"  dcp.async_save    {ck['dcp_async_block_s'] * 1e3:8.1f} ms")
    print(f"  resilient / dcp.async_save = {ck['ours_over_dcp_async']:.2f}")
    snap = snapshot_cost(args.steps, args.dim, args.layers)
    print(f"snapshots at interval auto, examples/train_fsdp2.py --dim {args.dim} --layers {args.layers}:")
    share = 100 * snap["share_of_step"]
    print(f"  runtime {snap['runtime_ms_per_step']:.3f} ms a step of {snap['step_ms']:.1f} ms ({share:.2f}%)")
    print(f"  {snap['snapshots']} snapshots in {snap['steps']} steps")
    if args.out is not None:
        results.write(args.out, {"checkpoint": ck, "snapshots": snap}, st)


if __name__ == "__main__":
    main()
