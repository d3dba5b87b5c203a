"""A dead rank replaced alone vs the whole group relaunched vs torchrun, side by side in one run.

The bundled example (examples/train_tiny.py: DDP over gloo, 2 ranks, steps padded to 50 ms) under

- **rank**: ``resilient launch --replace rank --standby 1`` (the default): the survivor stays in
  its process; a warm standby, parked in the script's ``resilient.wrap`` call, takes the dead
  rank's place and restores its shared-memory snapshot;
- **rank-import**: the same with ``--standby-mode import``: the standby has imported torch and the
  runtime only, and runs the script's imports and top level once promoted;
- **group**: ``resilient launch --replace group``: every worker is relaunched and restores from
  the shared-memory snapshots (the behaviour before replacement);
- **torchrun**: ``torchrun --max-restarts``, the script without the runtime, torch.save + fsync
  every 10 steps, resume from the newest step every rank wrote (SIGKILL only: it has no heartbeat,
  a stopped worker is waited for until the collective timeout).

and the peers that keep survivors or relaunch on their own terms (SIGKILL):

- **ft_launcher**: NVRx 0.4.1's launcher (rank monitors, heartbeats, relaunch) on its own small
  DDP worker with torch.save checkpoints (benchmarks/peers/nvrx_ft_launcher.py);
- **torchft**: torchft 0.2.0, two replica groups of one rank under its Lighthouse; one group's
  worker is killed, the survivor goes on, the killed group is relaunched and heals from it; the
  figure is kill → both groups committing again (benchmarks/peers/torchft_peer.py).

The resilient modes keep a durable checkpoint every 10 steps too (``--ckpt-dir``), which also
refreshes the shared-memory mirror: the steps a hard fault re-runs are bounded alike.

Rank 1 is sent the signal when it completes step ``--at`` and, in the rank modes, a standby
waits (its agent said ``standby_ready``; ``standby`` in each trial's line); recovery = the
driver's time from the signal until every rank completed a step again (per-step progress lines,
same host clock). SIGSTOP: the launcher's heartbeat timeout
(``--heartbeat-timeout``, 3 s) is part of the figure, and is also reported subtracted. Modes and
signals alternate trial by trial.

``--script hf`` runs examples/train_hf.py instead (a GPT-2 built from a config with
``transformers``, whose import alone takes seconds): rank, rank-import and group. Mode
**rank-prepare** is rank with the script's ``--prepare``: the script builds its model in
``resilient.wrap(prepare=...)``, which a parked standby runs before the fault, instead of inside
its function after the promotion (``--script-args '--layers 6 --width 384'``: a bigger model).

    python benchmarks/replace.py [--trials 10] [--at 100] [--script tiny|hf] [--modes rank,...]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.suite import EXAMPLE, RESULTS, ROOT, job, recoveries
from chaos import results

HEARTBEAT_S = 3.0
MODES = {
    "rank": ("resilient", ("--replace", "rank", "--standby", "1")),  # (a parked standby)
    "rank-prepare": ("resilient", ("--replace", "rank", "--standby", "1")),  # (and the script's --prepare)
    "rank-import": ("resilient", ("--replace", "rank", "--standby", "1", "--standby-mode", "import")),
    "group": ("resilient", ("--replace", "group")),
    "torchrun": ("torchrun", ()),
}
PEERS = ("ft_launcher", "torchft")
LAUNCH = ("--heartbeat-timeout", str(HEARTBEAT_S), "--backoff-initial", "0")


def peer_trial(mode: str) -> dict[str, Any]:
    if mode == "torchft":
        from benchmarks.peers import torchft_peer

        why = torchft_peer.available()
        r = {"recovered": False, "error": why} if why else torchft_peer.trial()
    else:
        from benchmarks.peers import nvrx_ft_launcher

        r = nvrx_ft_launcher.trial("sigkill")
        r["recovered"] = r.get("finished", False) and r.get("recover_s") is not None
    out = {"mode": mode, "signal": "SIGKILL", "finished": bool(r.get("recovered"))}
    if out["finished"]:
        out["recover_s"] = r["recover_s"]
    else:
        out["log"] = str(r.get("error") or r.get("log_tail") or r.get("dir"))[-1500:]
    return out


SCRIPTS = {"tiny": EXAMPLE, "hf": str(ROOT / "examples" / "train_hf.py")}


def trial(
    mode: str,
    sig: signal.Signals,
    at: int,
    steps: int,
    script: str = EXAMPLE,
    script_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    if mode in PEERS:
        return peer_trial(mode)
    engine, args = MODES[mode]
    launch = (*args, *LAUNCH) if engine == "resilient" else ()
    extra: tuple[str, ...] = ("--ckpt-dir", "ckpt", "--ckpt-every", "10") if engine == "resilient" else ()
    if mode == "rank-prepare":
        extra += ("--prepare",)
    extra += script_args
    r = job(engine, 2, steps, kills=(at,), launch_args=launch, extra=extra, kill_signal=sig, timeout=300,
            script=script, wait_standby=mode.startswith("rank"))  # fmt: skip
    got = recoveries(r)
    out: dict[str, Any] = {"mode": mode, "signal": sig.name, "finished": r["finished"]}
    kill = next((f for f in r["faults"] if "standby" in f), None)
    if kill is not None:
        out["standby"] = kill["standby"]  # (waited for in the rank modes: what a warm replacement costs)
    if r["finished"] and got and got[0]["recover_s"] == got[0]["recover_s"]:
        out.update(recover_s=got[0]["recover_s"], catchup_s=got[0]["catchup_s"], steps_lost=got[0]["lost"])
    else:
        out["log"] = r.get("log_tail", "")[-1500:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--at", type=int, default=100, help="the step after which rank 1 is signalled")
    ap.add_argument("--steps", type=int, default=140)
    ap.add_argument("--out", type=Path, default=RESULTS / "replace.json")
    ap.add_argument(
        "--script",
        choices=sorted(SCRIPTS),
        default="tiny",
        help="tiny: examples/train_tiny.py; hf: examples/train_hf.py (imports transformers)",
    )
    ap.add_argument("--modes", default=None, help="comma-separated SIGKILL modes (default: all)")
    ap.add_argument(
        "--script-args", default="", help="more arguments for the script (e.g. '--layers 6 --width 384')"
    )
    args = ap.parse_args()
    st = results.begin(trials=args.trials)
    runs: list[dict[str, Any]] = []
    plan = [(m, signal.SIGKILL) for m in (*MODES, *PEERS)] + [(m, signal.SIGSTOP) for m in ("rank", "group")]
    if args.modes:
        plan = [(m, signal.SIGKILL) for m in args.modes.split(",")]
    elif args.script != "tiny":  # (the torchrun baseline and the peers run the example's own loop)
        plan = [(m, signal.SIGKILL) for m in ("rank", "rank-import", "group")]
    for t in range(args.trials):
        for mode, sig in plan:
            r = trial(mode, sig, args.at, args.steps, SCRIPTS[args.script], tuple(args.script_args.split()))
            r["trial"] = t
            runs.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "log"}), flush=True)
    summary: dict[str, Any] = {}
    for mode, sig in plan:
        mine = [r for r in runs if (r["mode"], r["signal"]) == (mode, sig.name)]
        xs = sorted(r["recover_s"] for r in mine if "recover_s" in r)
        n = len(mine)
        key = f"{sig.name}/{mode}"
        if not xs:
            summary[key] = {"recovered": 0, "trials": n}
            continue
        med = statistics.median(xs)
        cs = [r["catchup_s"] for r in mine if "catchup_s" in r]
        ls = [r["steps_lost"] for r in mine if "steps_lost" in r]
        catchup = statistics.median(cs) if cs else None
        lost = statistics.median(ls) if ls else None
        summary[key] = {"recovered": len(xs), "trials": n, "median_s": med, "max_s": xs[-1],
                        "catchup_median_s": catchup, "steps_lost_median": lost}  # fmt: skip
        above = f"  (above the heartbeat timeout: {med - HEARTBEAT_S:.2f} s)" if sig is signal.SIGSTOP else ""
        print(
            f"{key:18s} {len(xs)}/{n}  median {med:.2f} s  max {xs[-1]:.2f} s  back at the step hit "
            + (f"{catchup:.2f} s  steps re-run {lost:g}" if catchup is not None else "n/a")
            + above
        )
    k = summary.get("SIGKILL/rank", {}).get("median_s")
    for other in ("rank-import", "group", "torchrun", *PEERS):
        o = summary.get(f"SIGKILL/{other}", {}).get("median_s")
        if k and o:
            print(f"SIGKILL: {other} / rank (medians) {o / k:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, {"summary": summary, "runs": runs}, st)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
