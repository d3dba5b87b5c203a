"""What the metrics endpoint costs a training step: runs with it and without, alternated (ABBA),
under plain torchrun (local rank 0 serves it, in the training process: the costlier case) and
under ``resilient launch --metrics-port`` (the agent serves it), each scraped once a second
(Prometheus's default is every 15 s).

Two figures per set-up:
- the step time with the endpoint over the step time without (medians of the runs; this
  machine's run-to-run spread is about 1%, so this only bounds the effect);
- the endpoint's own CPU time over the run's wall time, from its ``resilient_exporter_cpu_seconds``
  (reading the log, recomputing, answering scrapes): the time it can take from the training
  thread at most, measured exactly.

    python benchmarks/metrics_overhead.py [--pairs 3] [--steps 400] [--dim 256]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from chaos import results

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "train_tiny.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Scraper(threading.Thread):
    """Scrapes the endpoint every ``every_s``; keeps the last exporter CPU figure it saw."""

    def __init__(self, port: int, every_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s = f"http://127.0.0.1:{port}/metrics", every_s
        self.stop = threading.Event()
        self.cpu_s: float | None = None
        self.scrapes = 0

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
            except OSError:
                continue
            self.scrapes += 1
            for line in text.splitlines():
                if line.startswith("resilient_exporter_cpu_seconds_total"):
                    self.cpu_s = float(line.rsplit(" ", 1)[1])


def run(mode: str, metrics: bool, steps: int, dim: int) -> dict[str, float]:
    port = _port()
    with tempfile.TemporaryDirectory(prefix="metrics-ab-") as tmp:
        # compute-bound steps (no padding), so that CPU taken from the ranks shows in the step time
        args = [EXAMPLE, "--steps", str(steps), "--dim", str(dim), "--report"]
        if mode == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
            if metrics:
                (Path(tmp) / "cfg.yaml").write_text(f"metrics: {{port: {port}, addr: 127.0.0.1}}\n")
                args += ["--config", str(Path(tmp) / "cfg.yaml")]
        else:
            cmd = [sys.executable, "-m", "resilient.cli", "launch", "--standalone", "--nproc-per-node", "2"]
            if metrics:
                cmd += ["--metrics-port", str(port), "--metrics-addr", "127.0.0.1", "--metrics-linger", "1.5"]
        scraper = Scraper(port)
        scraper.start()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        t0 = time.monotonic()
        out = subprocess.run([*cmd, *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
        wall = time.monotonic() - t0
        scraper.stop.set()
        scraper.join()
    if out.returncode != 0:
        raise SystemExit(f"{mode} metrics={metrics} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    rep = next(json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith('{"loop_s"'))
    res = {"step_s": rep["loop_s"] / rep["steps"], "wall_s": wall, "scrapes": scraper.scrapes}
    if metrics:
        res["exporter_cpu_s"] = scraper.cpu_s if scraper.cpu_s is not None else float("nan")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=3, help="ABBA pairs per set-up")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--dim", type=int, default=256, help="the example's model width (its step time)")
    p.add_argument("--modes", default="torchrun,launch")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "metrics_overhead.json")
    a = p.parse_args()
    st = results.begin(pairs=a.pairs)
    by_mode: dict[str, dict[str, list[dict[str, float]]]] = {}
    for mode in a.modes.split(","):
        on: list[dict[str, float]] = []
        off: list[dict[str, float]] = []
        for i in range(a.pairs):
            order = (False, True, True, False) if i % 2 == 0 else (True, False, False, True)
            for m in order:
                (on if m else off).append(run(mode, m, a.steps, a.dim))
        by_mode[mode] = {"on": on, "off": off}
        s_on = statistics.median(r["step_s"] for r in on)
        s_off = statistics.median(r["step_s"] for r in off)
        share = statistics.median(r["exporter_cpu_s"] / r["wall_s"] for r in on)
        print(
            f"{mode:9s} step with endpoint {1e3 * s_on:.3f} ms, without {1e3 * s_off:.3f} ms: "
            f"{100 * (s_on / s_off - 1):+.2f}% (runs {len(on)}+{len(off)}); endpoint CPU / wall "
            f"{100 * share:.3f}% ({min(r['scrapes'] for r in on):.0f}+ scrapes a run)",
            flush=True,
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(a.out, by_mode, st)


if __name__ == "__main__":
    main()
