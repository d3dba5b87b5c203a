"""User-style training scripts (examples/): an FSDP2 transformer and a DDP epoch loop over a
DataLoader, each under a real fault, must end bit for bit where the fault-free run ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from chaos.harness import run_ranks
from tests.integration.conftest import ROOT, assert_bit_exact

pytestmark = pytest.mark.integration

FSDP2 = str(ROOT / "examples" / "train_fsdp2.py")
EPOCHS = str(ROOT / "examples" / "train_ddp_epochs.py")
ACCUM = str(ROOT / "examples" / "train_accum.py")


def _run(
    tmp: Path,
    name: str,
    argv: list[str],
    plan: str = "",
    restored: int | tuple[int, ...] | None = None,
    timeout: float = 180,
) -> list[dict[str, Any]]:
    cwd = tmp / name
    cwd.mkdir(parents=True)
    env = {"CHAOS_FINAL_STATE": str(cwd / "state")}
    if plan:
        env["CHAOS_PLAN"] = plan
    res = run_ranks(argv, 2, cwd=cwd, run_id=name, env=env, timeout=timeout)
    assert res.ok, res.describe()
    fired = res.of("fault_detected")
    assert bool(fired) == bool(plan), fired
    assert not res.of("untracked_state"), res.of("untracked_state")  # (the examples keep none)
    if restored is not None:  # every rank restored the same step: that one, or one of those
        allowed = restored if isinstance(restored, tuple) else (restored,)
        steps = {e["step"] for e in res.of("state_restored")}
        assert len(steps) == 1 and steps <= set(allowed), res.of("state_restored")
    return [torch.load(cwd / "state" / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def _same(ref: list[dict[str, Any]], hit: list[dict[str, Any]]) -> int:
    n = 0
    for r, (a, b) in enumerate(zip(ref, hit, strict=True)):
        for s in (a, b):  # the RNG state the loader's current pass began from: compared via the stream
            s.get("loader", {}).pop("rng", None)
        n += assert_bit_exact(a, b, f"rank{r}")
    return n


def test_fsdp2_transformer_recovers_bit_exact(tmp_path: Path) -> None:
    argv = [FSDP2, "--steps", "24"]
    ref = _run(tmp_path, "ref", argv)
    hit = _run(tmp_path, "hit", argv, plan="exception@13:1")
    # the model and AdamW state are each rank's local shards (FSDP2 keeps them as DTensors)
    assert "__dtensor__" in next(iter(ref[0]["model"].values()))
    assert _same(ref, hit) > 60


@pytest.mark.parametrize(
    ("workers", "live"),
    [pytest.param(0, False, marks=pytest.mark.slow), (2, True)],
    ids=["ring", "live-workers"],
)
def test_dataloader_epoch_loop_resumes_mid_epoch_bit_exact(tmp_path: Path, workers: int, live: bool) -> None:
    # snapshots every 5 steps, 16 batches an epoch: the fault as step 23 begins resumes there
    # (live) or restores step 20 (the ring), the 5th batch of the 2nd epoch (either is what the
    # rules admit with live on: a loaded machine may fall back); dropout and the loader's worker
    # RNGs must continue as they were
    cfg = tmp_path / "every5.yaml"
    cfg.write_text(f"snapshot:\n  interval: 5\n  live: {str(live).lower()}\n")
    argv = [EPOCHS, "--epochs", "2", "--num-workers", str(workers)]
    ref = _run(tmp_path, "ref", argv)
    hit = _run(
        tmp_path,
        "hit",
        [*argv, "--config", str(cfg)],
        plan="exception@23:1",
        restored=(23, 20) if live else 20,
    )
    assert _same(ref, hit) >= 8


def test_a_stateful_dataloader_in_the_manual_loop_resumes_mid_epoch_bit_exact(tmp_path: Path) -> None:
    # torchdata's StatefulDataLoader + DistributedSampler + dropout, ctx.steps(n) with a new
    # iter(loader) at each epoch's start (the DDP tutorial's loop), no generator on the loader:
    # the restored iterator must not draw its seeds from the restored RNG a second time (resumed
    # live at step 23, the loader's state as that step began, or from the ring's step 20)
    pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    cfg = tmp_path / "every5.yaml"
    cfg.write_text("snapshot:\n  interval: 5\n")
    argv = [EPOCHS, "--epochs", "2", "--loader", "stateful", "--loop", "manual"]
    ref = _run(tmp_path, "ref", argv)
    hit = _run(tmp_path, "hit", [*argv, "--config", str(cfg)], plan="exception@23:1", restored=(23, 20))
    assert _same(ref, hit) >= 8


@pytest.mark.slow  # (CI's budget: a StatefulDataLoader's mid-epoch resume stays in CI)
def test_a_stateful_dataloader_with_workers_outlives_a_sigkill_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the same loop, 2 loader worker processes each, under `resilient launch`: rank 1 is
    # SIGKILLed in the 2nd epoch and replaced; the replacement resumes its loader (workers, seeds)
    # from the shared-memory snapshot
    import os
    import signal

    from tests.integration.test_launcher import Launch

    pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata is not installed")
    argv = [EPOCHS, "--epochs", "2", "--loader", "stateful", "--loop", "manual", "--num-workers", "2"]
    ref = _run(tmp_path, "ref", argv)
    cfg = tmp_path / "every5.yaml"
    cfg.write_text("snapshot:\n  interval: 5\nevents:\n  steps: true\n")
    state = tmp_path / "hit" / "state"
    monkeypatch.setenv("CHAOS_FINAL_STATE", str(state))
    monkeypatch.setenv("RESILIENT_HOOKS", "chaos.hooks:from_env")  # (what run_ranks names for a chaos run)
    run = Launch(tmp_path / "hit", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
                 "--monitor-interval", "0.2",
                 "--heartbeat-timeout", "5", *argv, "--config", str(cfg))  # fmt: skip
    try:
        hit = run.wait_event("step_completed", lambda e: e["rank"] == 1 and e["step"] >= 21, timeout=90)
        os.kill(int(next(e for e in run.events() if e["event"] == "run_started" and e["rank"] == 1)["pid"]),
                signal.SIGKILL)  # fmt: skip
        rc = run.finish()
    finally:
        if run.p.poll() is None:
            run.finish(timeout=1)
    assert rc == 0, run.output()
    events = run.events()
    assert [e for e in events if e["event"] == "rank_replaced"], [
        e["event"] for e in events if e["rank"] == -1
    ]
    restored = [e for e in events if e["event"] == "state_restored" and e["ts"] > hit["ts"]]
    assert {e["rank"] for e in restored} == {0, 1} and len({e["step"] for e in restored}) == 1, restored
    got = [torch.load(state / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert _same(ref, got) >= 8


def test_fault_inside_an_accumulation_window_recovers_bit_exact(tmp_path: Path) -> None:
    # each micro-batch a step, the optimizer every 4th (no_sync between), fp16 autocast with a
    # GradScaler, activation checkpointing over dropout: the fault as step 11 begins, three
    # micro-batches into a window, resumes there live, its pending gradients carried (the ring's
    # restore inside a window: tests/integration/test_hf_trainer.py, tests/unit/test_live.py)
    cfg = tmp_path / "every5.yaml"
    cfg.write_text("snapshot:\n  interval: 5\n")
    argv = [ACCUM, "--epochs", "1", "--config", str(cfg)]
    ref = _run(tmp_path, "ref", argv)
    # (rank 0 may already have run its backward of step 11 under no_sync: then it cannot vouch)
    hit = _run(tmp_path, "hit", argv, plan="exception@11:1", restored=(11, 10, 5))
    assert ref[0]["scaler"]["scale"] != 65536.0 or ref[0]["scaler"]["_growth_tracker"] > 0  # it ran
    assert _same(ref, hit) >= 10


@pytest.mark.slow  # inductor compiles for about a minute on a cold cache with 2 cores
def test_a_compiled_model_reentered_after_a_fault_recovers_bit_exact(tmp_path: Path) -> None:
    # the rebuilt model is compiled again on re-entry: dynamo's cache serves it (no new compile
    # within the process) and the compiled dropout replays the restored RNG
    argv = [ACCUM, "--epochs", "1", "--compile", "--amp", "bf16"]
    ref = _run(tmp_path, "ref", argv, timeout=600)
    hit = _run(tmp_path, "hit", argv, plan="exception@11:1", timeout=600)
    assert _same(ref, hit) >= 10


# (4 ranks on 2 cores: the slow session; CI recovers FSDP2 at 2 ranks, test_fsdp2_transformer_...)
@pytest.mark.parametrize("mesh", [pytest.param("--hsdp", marks=pytest.mark.slow),
                                  pytest.param("--tp", marks=pytest.mark.slow)])  # fmt: skip
def test_a_2d_mesh_recovers_bit_exact_at_4_ranks(tmp_path: Path, mesh: str) -> None:
    # HSDP (replicas of 2-way shards) and FSDP + TP (FSDP across pairs that split the MLPs): the
    # peers of the failing rank block in a collective on a mesh dimension's own group, so the abort
    # must reach that group too, or they wait out the collective timeout and die
    argv = [FSDP2, "--steps", "16", mesh]

    def run(name: str, plan: str = "") -> list[dict[str, Any]]:
        cwd = tmp_path / name
        cwd.mkdir()
        env = {"CHAOS_FINAL_STATE": str(cwd / "state"), **({"CHAOS_PLAN": plan} if plan else {})}
        res = run_ranks(argv, 4, cwd=cwd, run_id=name, env=env, timeout=240)
        assert res.ok, res.describe()
        assert len({e["pid"] for e in res.events if e["rank"] == 0}) == 1  # in-process
        if plan:
            assert res.of("state_restored"), res.describe()
        return [torch.load(cwd / "state" / f"rank{r}.pt", weights_only=False) for r in range(4)]

    ref, hit = run("ref"), run("hit", "exception@9:3")
    layouts = [leaf["__dtensor__"]["placements"] for leaf in ref[0]["model"].values()]
    if mesh == "--hsdp":  # every parameter on the 2-D mesh: replicated across, sharded within
        assert all(p == [["replicate"], ["shard", 0]] for p in layouts), layouts
    else:  # the MLPs' weights on (dp, tp); the rest FSDP-sharded on dp alone
        assert {len(p) for p in layouts} == {1, 2}, layouts
    pairs = enumerate(zip(ref, hit, strict=True))
    assert sum(assert_bit_exact(a, b, f"rank{r}") for r, (a, b) in pairs) > 400


def _full(states: list[dict[str, Any]], obj: str) -> dict[str, torch.Tensor]:
    """Each FSDP2 leaf of ``obj`` put together from the ranks' local shards (dim-0 shards, in rank
    order: FSDP2's 1-D layout), by its path; assembled here without the runtime's own index code."""
    out: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: str, r: int) -> None:
        if isinstance(node, dict) and "__dtensor__" in node:
            out.setdefault(path, [None] * len(states))[r] = node["local"]  # type: ignore[index]
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}/{k}", r)

    for r, s in enumerate(states):
        walk(s[obj], "", r)
    return {p: torch.cat(parts) for p, parts in out.items()}  # type: ignore[arg-type]


# (the slow session: test_resharding.py writes at 4 and loads at 2 in CI, on the same DCP path)
@pytest.mark.slow
def test_fsdp2_checkpoint_of_4_ranks_resumes_resharded_on_2(tmp_path: Path) -> None:
    # the job shrinks: a checkpoint written by 4 ranks is loaded by 2, each reading the parts of
    # the old shards its new shard covers; the model and AdamW state are the same tensors
    ckpt = tmp_path / "ckpt"
    argv = [FSDP2, "--steps", "20", "--ckpt-dir", str(ckpt), "--ckpt-every", "10"]

    def run(name: str, nproc: int, extra: list[str] = ()) -> tuple[list[dict[str, Any]], Any]:  # type: ignore[assignment]
        cwd = tmp_path / name
        cwd.mkdir()
        env = {"CHAOS_FINAL_STATE": str(cwd / "state")}
        res = run_ranks([*argv, *extra], nproc, cwd=cwd, run_id=name, env=env, timeout=240)
        assert res.ok, res.describe()
        return [torch.load(cwd / "state" / f"rank{r}.pt", weights_only=False) for r in range(nproc)], res

    four, _ = run("four", 4)
    two, res = run("two", 2)  # resumes at step 20, the last: its final state is what it loaded
    loaded = res.of("checkpoint_loaded")
    assert {(e["step"], e["resharded_from"]) for e in loaded} == {(20, 4)}, loaded
    for e in loaded:  # each rank's token stream is its own: the old rank's of the same number
        assert "data" in e["per_rank_from"] and e["per_rank_from"]["data"] == e["rank"], e
        assert not {"model", "optimizer", "scheduler"} & set(e["per_rank_from"]), e
    n = 0
    for obj in ("model", "optimizer"):
        before, after = _full(four, obj), _full(two, obj)
        assert before.keys() == after.keys() and len(before) > 10
        for path, t in before.items():
            assert torch.equal(t, after[path]), f"{obj}{path}"
            n += 1
    assert n > 30
    for r in (0, 1):  # replicated objects as they were; per-rank ones from the same old rank
        assert four[r]["scheduler"] == two[r]["scheduler"]
        assert torch.equal(four[r]["data"]["generator"], two[r]["data"]["generator"])
        assert four[r]["optimizer"]["param_groups"] == two[r]["optimizer"]["param_groups"]
    _, more = run("more", 2, ["--steps", "24"])  # and training goes on from there at 2 ranks
    assert {e["step"] for e in more.of("checkpoint_loaded")} == {20}
