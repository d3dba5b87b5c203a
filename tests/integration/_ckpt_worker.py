"""Worker for the checkpoint fault tests: saves (or snapshots) a state whose content is a pure
function of the step, forever, until it is killed. Prints one line per commit.

    python _ckpt_worker.py ckpt ROOT    # Checkpointer: resume from the newest, then save every step
    python _ckpt_worker.py shm NAME     # ShmSnapshot: capture every step
"""

from __future__ import annotations

import sys

import torch

from resilient.checkpoint.manager import Checkpointer
from resilient.checkpoint.shm import ShmSnapshot


def state_at(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {
        "frozen": torch.ones(512, 1024) * 7,  # 2 MB that never changes: referenced, not rewritten
        "weights": torch.randn(1024, 1024, generator=g),  # 4 MB that changes every step
        "meta": {"step": step, "tag": f"s{step}"},
    }


def main() -> None:
    mode, where = sys.argv[1], sys.argv[2]
    if mode == "ckpt":
        ck = Checkpointer(where, keep=2)
        loaded = ck.load_latest()
        step = loaded.step + 1 if loaded is not None else 1
        while True:
            ck.save(step, state_at(step))
            ck.wait()
            print(f"committed {step}", flush=True)
            step += 1
    else:
        snap = ShmSnapshot(where)
        step = 1
        while True:
            snap.capture(step, state_at(step))
            print(f"captured {step}", flush=True)
            step += 1


if __name__ == "__main__":
    main()
