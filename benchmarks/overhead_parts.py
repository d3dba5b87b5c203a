"""Where the whole runtime's fault-free overhead goes: the suite's A/B (benchmarks/suite.py,
``overhead``) with one part of the runtime turned off at a time.

The bundled example under ``resilient launch`` at its defaults, and the same with each of these
off through its configuration key, against the plain script under torchrun (no checkpoints on
either side), on the suite's model (a step of ~100 ms of compute, no padding), 2 gloo ranks:

- ``live``: ``snapshot.live: false`` (no capture of the live state, no mirror of it);
- ``guard``: ``guard.nonfinite: false`` and ``guard.spike: 0`` (no gradient norm before a step);
- ``sdc``: ``sdc.enabled: false`` (no replica digests);
- ``replay``: ``verify_replay: off`` (no replay digest);
- ``count``: ``collective_check: false`` (no collective count);
- ``straggler``: ``straggler.enabled: false``;
- ``all``: every part above off at once;
- ``torchrun``: the runtime at its defaults under torchrun instead of ``resilient launch`` (no
  agent, standby, heartbeats nor shared-memory mirror).

Runs are interleaved round by round, the order rotating; per configuration the median wall
time per step (rank 0, first step to last) over the rounds, and its difference from the
defaults: what that part costs.

    python benchmarks/overhead_parts.py [--rounds 3] [--steps 300]

Writes benchmarks/results/overhead_parts.json (stamped) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.suite import RESULTS, _wall_step, job  # noqa: E402
from chaos import results  # noqa: E402

MODEL = ("--dim", "224", "--seq", "64")
OFF: dict[str, dict[str, Any]] = {
    "defaults": {},
    "live": {"snapshot": {"live": False}},
    "guard": {"guard": {"nonfinite": False, "spike": 0}},
    "sdc": {"sdc": {"enabled": False}},
    "replay": {"verify_replay": "off"},
    "count": {"collective_check": False},
    "straggler": {"straggler": {"enabled": False}},
}
OFF["all"] = {k: v for part in OFF.values() for k, v in part.items()}


def one(name: str, steps: int, where: Path) -> float | None:
    """Rank 0's wall time per step of one run of ``name`` (``plain``: the script under torchrun)."""
    if name == "plain":
        r = job("torchrun", 2, steps, step_ms=0.0, extra=MODEL, plain_ckpt=False)
    elif name == "torchrun":
        r = job("wrapped", 2, steps, step_ms=0.0, extra=MODEL)
    else:
        cfg = where / f"{name}.yaml"
        cfg.write_text(json.dumps(OFF[name]))  # (JSON is YAML)
        r = job("resilient", 2, steps, step_ms=0.0, extra=(*MODEL, "--config", str(cfg)))
    return _wall_step(r) if r["finished"] else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=RESULTS / "overhead_parts.json")
    a = ap.parse_args()
    st = results.begin(trials=a.rounds)
    names = ["plain", *OFF, "torchrun"]
    per: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                got = one(name, a.steps, Path(tmp))
                if got is not None:
                    per[name].append(got)
                print(json.dumps({"round": i, "config": name, "step_s": got}), flush=True)
    med = {n: statistics.median(v) if v else None for n, v in per.items()}
    base, full = med["plain"], med["defaults"]
    parts = {
        n: {
            "step_ms": None if med[n] is None else 1e3 * med[n],
            "vs_plain_pct": None if not (med[n] and base) else 100 * (med[n] / base - 1),
            "its_cost_ms": None
            if not (med[n] and full) or n in ("plain", "defaults")
            else 1e3 * (full - med[n]),
        }
        for n in names
    }
    report = {"rounds": a.rounds, "steps": a.steps, "model": list(MODEL), "off": OFF, "parts": parts}
    results.write(a.out, {**report, "samples": per}, st)
    print(f"{'config':10s} {'ms/step':>8s} {'vs plain':>9s} {'its cost':>9s}")
    for n, p in parts.items():
        ms, pct, cost = p["step_ms"], p["vs_plain_pct"], p["its_cost_ms"]
        print(f"{n:10s} {ms or 0:8.2f} {pct or 0:+8.1f}% {'' if cost is None else f'{cost:+.2f} ms':>9s}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
