"""What the collective check costs (counts compared where state is kept), side by side in one run.

The bundled example (DDP over gloo, model sized for ~50 ms steps here) runs with
``collective_check`` on and off, interleaved. Figures: wall clock per step (noisy on a shared
2-core machine) and the runtime's own accounting of main-thread time per step (run_finished's
``runtime_ms_per_step``, which includes the check's store round trips and its wait for the
neighbour's count).

    python benchmarks/collective_check.py [--runs 4] [--steps 300] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos import results  # noqa: E402
from chaos.harness import run_ranks  # noqa: E402
from resilient.events import Event  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "train_tiny.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4, help="runs per mode, interleaved")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dim", type=int, default=160)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "collective_check.json")
    args = ap.parse_args()
    st = results.begin(trials=args.runs)
    wall: dict[str, list[float]] = {"on": [], "off": []}
    hook: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * args.runs):
        mode = "off" if i % 2 else "on"
        with tempfile.TemporaryDirectory() as d:
            cfg = Path(d) / "c.yaml"
            cfg.write_text(f"collective_check: {'true' if mode == 'on' else 'false'}\n")
            argv = [EXAMPLE, "--steps", str(args.steps), "--dim", str(args.dim), "--seq", str(args.seq),
                    "--report", "--config", str(cfg)]  # fmt: skip
            res = run_ranks(argv, args.nproc, cwd=Path(d), run_id=f"cc{i}", timeout=900)
            assert res.ok, res.describe()
            rep = json.loads(res.ranks[0].stdout.strip().splitlines()[-1])
            wall[mode].append(rep["loop_s"] / rep["steps"] * 1e3)
            hook[mode] += [e["runtime_ms_per_step"] for e in res.of(Event.RUN_FINISHED)]
    med = {k: statistics.median(v) for k, v in wall.items()}
    hmed = {k: statistics.median(v) for k, v in hook.items()}
    result = {
        "nproc": args.nproc, "runs_per_mode": args.runs, "steps": args.steps,
        "step_ms": med, "step_ms_all": wall, "runtime_ms_per_step": hmed,
        "check_ms_per_step": hmed["on"] - hmed["off"],
        "check_pct_of_step": 100 * (hmed["on"] - hmed["off"]) / med["off"],
        "wall_overhead_pct": 100 * (med["on"] - med["off"]) / med["off"],
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, result, st)
    print(f"step (wall, median of {args.runs}): check off {med['off']:.2f} ms, on {med['on']:.2f} ms "
          f"({result['wall_overhead_pct']:+.2f}%)")  # fmt: skip
    print(f"runtime main-thread time per step: off {hmed['off']:.3f} ms, on {hmed['on']:.3f} ms")
    cost, pct = result["check_ms_per_step"], result["check_pct_of_step"]
    print(f"the check costs {cost:.3f} ms/step = {pct:.2f}% of a step")


if __name__ == "__main__":
    main()
