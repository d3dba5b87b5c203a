"""What a checkpoint costs a Python-bound training loop, step by step: writer thread vs process.

The example's model (dim 32, ~2.3 ms steps on one core) trains 600 steps with a checkpoint every 10;
per writer kind this prints the median time of the saving step, of the step right after it (where
the writer runs concurrently), and of the others, plus the loop's total.

    python benchmarks/checkpoint_gil.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from train_tiny import TinyLM, Tokens  # noqa: E402

from resilient.checkpoint.manager import Checkpointer  # noqa: E402


def run(writer: str | None, steps: int = 600, every: int = 10) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyLM(dim=32, seq=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = Tokens(seed=1, seq=16)
    with tempfile.TemporaryDirectory() as d:
        ck = Checkpointer(d, token="bench", writer=writer) if writer else None
        if ck is not None:  # the writer (a process imports torch: ~1 s) is up before timing
            ck.save(0, {"model": model.state_dict(), "optim": opt.state_dict()})
            ck.wait()
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            x, y = data.next()
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if ck is not None and i % every == every - 1:
                ck.save(i + 1, {"model": model.state_dict(), "optim": opt.state_dict()})
            times.append(time.perf_counter() - t0)
        if ck is not None:
            ck.close()
    t = times[100:]  # warm-up
    k = [i % every for i in range(100, steps)]
    return {
        "save_step_ms": 1e3 * statistics.median(x for x, j in zip(t, k, strict=True) if j == every - 1),
        "next_step_ms": 1e3 * statistics.median(x for x, j in zip(t, k, strict=True) if j == 0),
        "other_ms": 1e3 * statistics.median(x for x, j in zip(t, k, strict=True) if 0 < j < every - 1),
        "total_s": sum(t),
    }


def main() -> None:
    torch.set_num_threads(1)
    for writer in (None, "thread", "process"):
        r = run(writer)
        print(
            f"{writer or 'no checkpoints':15s} saving step {r['save_step_ms']:.2f} ms  next step "
            f"{r['next_step_ms']:.2f} ms  other steps {r['other_ms']:.2f} ms  500 steps {r['total_s']:.3f} s"
        )


if __name__ == "__main__":
    main()
