"""What the runtime costs a fault-free step, with its defaults (collective check on), side by side.

Three ways to run the bundled example (tiny transformer LM, DDP over gloo, 2 ranks, ~50 ms steps
here), interleaved so that drift of a shared machine hits each alike:

- ``plain``: the same loop without the runtime (``--plain``), env:// ranks as torchrun starts them;
- ``wrapped``: ``@resilient.wrap`` under the same plain ranks (torchrun's path);
- ``launch``: ``@resilient.wrap`` under ``resilient launch`` (shared-memory mirror, heartbeats).

Per mode: the median per-step wall clock over the loop (rank 0 times steps 5..N) and the
runtime's own main-thread time per step (``run_finished``'s accounting). The overhead is the
median over rounds of each round's wrapped/plain ratio (a round runs every mode back to back, so
the machine's slow drifts cancel), and, for reference, the ratio of the medians.

    python benchmarks/overhead.py [--runs 5] [--steps 300] [--dim 160]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos import results  # noqa: E402
from chaos.harness import run_ranks  # noqa: E402
from resilient.events import Event, read_run_events  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "train_tiny.py")
MODES = ("plain", "wrapped", "launch")


def _report(stdout: str) -> dict[str, float]:
    lines = [ln for ln in stdout.splitlines() if ln.startswith('{"loop_s"')]
    if not lines:
        raise RuntimeError(f"no timing line in the output:\n{stdout[-2000:]}")
    return json.loads(lines[-1])


def one_run(mode: str, nproc: int, steps: int, dim: int, seq: int, i: int) -> tuple[float, float | None]:
    """(ms per step on rank 0, the runtime's own ms per step or None for the plain loop)."""
    argv = [EXAMPLE, "--steps", str(steps), "--dim", str(dim), "--seq", str(seq), "--report"]
    with tempfile.TemporaryDirectory() as d:
        cwd = Path(d)
        if mode == "launch":
            cmd = [sys.executable, "-m", "resilient.cli", "launch", "--standalone", "--nproc-per-node",
                   str(nproc), "--events-dir", str(cwd / "resilient_runs"), *argv]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                tail = out.stdout[-2000:] + out.stderr[-2000:]
                raise RuntimeError(f"launch failed ({out.returncode}):\n{tail}")
            rep = _report(out.stdout)
        else:
            res = run_ranks([*argv, *(["--plain"] if mode == "plain" else [])], nproc, cwd=cwd,
                            run_id=f"ovh-{mode}-{i}", timeout=900)  # fmt: skip
            if not res.ok:
                raise RuntimeError(res.describe())
            rep = _report(res.ranks[0].stdout)
        hook = [e["runtime_ms_per_step"] for e in read_run_events(cwd / "resilient_runs")
                if e["event"] == Event.RUN_FINISHED and e["rank"] == 0]  # fmt: skip
    return rep["loop_s"] / rep["steps"] * 1e3, (hook[0] if hook else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs of each mode")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dim", type=int, default=160, help="model width (~50 ms steps on 2 CPU cores)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "overhead.json")
    args = ap.parse_args()
    st = results.begin(trials=args.runs)
    step_ms: dict[str, list[float]] = {m: [] for m in MODES}
    own_ms: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.runs):
        order = MODES[i % 3 :] + MODES[: i % 3]  # rotate: no mode always runs first
        for mode in order:
            ms, own = one_run(mode, args.nproc, args.steps, args.dim, args.seq, i)
            step_ms[mode].append(ms)
            if own is not None:
                own_ms[mode].append(own)
            print(f"run {i} {mode:8s} {ms:7.2f} ms/step" + (f"  runtime {own:.3f} ms/step" if own else ""),
                  flush=True)  # fmt: skip
    plain = statistics.median(step_ms["plain"])
    result: dict[str, object] = {"runs_each": args.runs, "steps": args.steps, "nproc": args.nproc}
    head = f"{'mode':8s} {'median ms/step':>15s} {'range':>15s} {'paired':>8s} {'medians':>8s}"
    head += f" {'runtime ms/step':>16s}"
    print("\n" + head)
    for mode in MODES:
        med = statistics.median(step_ms[mode])
        own = statistics.median(own_ms[mode]) if own_ms[mode] else None
        ratios = [m / p for m, p in zip(step_ms[mode], step_ms["plain"], strict=True)]
        paired = 100 * (statistics.median(ratios) - 1)
        pct = 100 * (med - plain) / plain
        result[mode] = {"step_ms": med, "range_ms": [min(step_ms[mode]), max(step_ms[mode])],
                        "overhead_pct_paired": paired, "overhead_pct_medians": pct,
                        "runtime_ms_per_step": own,
                        "runtime_pct_of_step": 100 * own / plain if own is not None else None}  # fmt: skip
        rng = f"{min(step_ms[mode]):.2f}-{max(step_ms[mode]):.2f}"
        own_s = f"{own:.3f} ({100 * own / plain:.2f}%)" if own is not None else "—"
        print(f"{mode:8s} {med:15.2f} {rng:>15s} {paired:+7.2f}% {pct:+7.2f}% {own_s:>16s}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, result, st)


if __name__ == "__main__":
    main()
