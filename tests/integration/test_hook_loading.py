"""A plain wrapped training run does not import the chaos harness; one whose environment names the
chaos hook in ``RESILIENT_HOOKS`` loads it (and the hook works: it dumps the final state)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

# a world of one, no launcher: the runtime hosts its own store
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import resilient

    @resilient.wrap(hang_timeout=5)
    def train(ctx):
        model = torch.nn.Linear(3, 1, bias=False)
        torch.nn.init.zeros_(model.weight)
        ctx.track(model=model)
        for _ in ctx.steps(4):
            with torch.no_grad():
                model.weight += 1

    train()
    print(json.dumps(sorted(m for m in sys.modules if m == "chaos" or m.startswith("chaos."))))
""")


def _run(tmp_path: Path, **extra: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHAOS_", "RESILIENT_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", **extra)
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return list(json.loads(r.stdout.strip().splitlines()[-1]))


def test_a_plain_run_does_not_import_chaos(tmp_path: Path) -> None:
    assert _run(tmp_path) == []


def test_a_run_naming_the_chaos_hook_loads_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    loaded = _run(tmp_path, RESILIENT_HOOKS="chaos.hooks:from_env", CHAOS_FINAL_STATE=str(state))
    assert "chaos.hooks" in loaded
    final = torch.load(state / "rank0.pt", weights_only=True)  # the hook's on_finish ran
    assert torch.equal(final["model"]["weight"], torch.full((1, 3), 4.0)), final
