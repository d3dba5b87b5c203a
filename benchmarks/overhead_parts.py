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
- ``standby``: ``resilient launch --standby 0`` (no standby waiting beside the ranks);
- ``torchrun``: the runtime at its defaults under torchrun instead of ``resilient launch`` (no
  agent, standby, heartbeats nor shared-memory mirror).

Runs are interleaved round by round, the order rotating; per configuration, the medians over
the rounds of rank 0's wall time per step (first step to last, and over the loop's second half,
once the standby's one-off imports are done) and of its CPU time per step, each against the
plain script's: what that part costs is its row's difference from the defaults' row.

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

from benchmarks.suite import RESULTS, _per_step, job  # noqa: E402
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


FIGURES = ("wall", "steady", "cpu")


def one(name: str, steps: int, where: Path) -> dict[str, float | None] | None:
    """Rank 0's wall time per step, over the whole loop and its second half, and its CPU time
    per step, of one run of ``name`` (``plain``: the script under torchrun)."""
    if name == "plain":
        r = job("torchrun", 2, steps, step_ms=0.0, extra=MODEL, plain_ckpt=False)
    elif name == "torchrun":
        r = job("wrapped", 2, steps, step_ms=0.0, extra=MODEL)
    elif name == "standby":
        r = job("resilient", 2, steps, step_ms=0.0, extra=MODEL, launch_args=("--standby", "0"))
    else:
        cfg = where / f"{name}.yaml"
        cfg.write_text(json.dumps(OFF[name]))  # (JSON is YAML)
        r = job("resilient", 2, steps, step_ms=0.0, extra=(*MODEL, "--config", str(cfg)))
    if not r["finished"]:
        return None
    return {"wall": _per_step(r, "t"), "steady": _per_step(r, "t", True), "cpu": _per_step(r, "cpu")}


def summary(per: dict[str, list[dict[str, float | None]]]) -> dict[str, dict[str, Any]]:
    """Per configuration and figure: the median in ms and its difference from the plain script's."""
    out: dict[str, dict[str, Any]] = {}
    for n, runs in per.items():
        out[n] = {}
        for f in FIGURES:
            xs = [r[f] for r in runs if r[f] is not None]
            base = [r[f] for r in per["plain"] if r[f] is not None]
            med = statistics.median(xs) if xs else None
            ref = statistics.median(base) if base else None
            pct = None if not (med and ref) else 100 * (med / ref - 1)
            out[n][f] = {"ms": None if med is None else 1e3 * med, "vs_plain_pct": pct}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=RESULTS / "overhead_parts.json")
    a = ap.parse_args()
    st = results.begin(trials=a.rounds)
    names = ["plain", *OFF, "standby", "torchrun"]
    per: dict[str, list[dict[str, float | None]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.rounds):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                got = one(name, a.steps, Path(tmp))
                if got is not None:
                    per[name].append(got)
                print(json.dumps({"round": i, "config": name, "per_step_s": got}), flush=True)
    parts = summary(per)
    report = {"rounds": a.rounds, "steps": a.steps, "model": list(MODEL), "off": OFF, "parts": parts}
    results.write(a.out, {**report, "samples": per}, st)
    print(f"{'config':10s} " + " ".join(f"{f + ' ms':>10s} {'vs plain':>8s}" for f in FIGURES))
    for n, p in parts.items():
        cells = [f"{p[f]['ms'] or 0:10.2f} {p[f]['vs_plain_pct'] or 0:+7.1f}%" for f in FIGURES]
        print(f"{n:10s} " + " ".join(cells))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
