"""Health checks: each built-in's verdict and the value it reports, and run_checks' error handling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from resilient import health
from resilient.config import HealthConfig
from resilient.health import CheckResult, HealthInput, run_checks


def inp(store: dist.Store | None = None, **cfg: object) -> HealthInput:
    c = HealthConfig(**cfg)
    return HealthInput(rank=1, generation=4, store=store, cfg=c, checkpoint_dir=c.checkpoint_dir)


def test_host_memory_passes_with_a_modest_minimum():
    r = health.host_memory(inp(min_host_memory_mb=1))
    assert r.ok and r.name == "host_memory"


def test_host_memory_fails_with_an_impossible_minimum_and_names_what_is_available():
    r = health.host_memory(inp(min_host_memory_mb=1e12))
    assert not r.ok
    assert str(r.value).endswith("MB available")
    assert float(str(r.value).split()[0]) > 0
    assert "1e+12" in r.detail


def test_checkpoint_dir_that_cannot_be_created_fails(tmp_path: Path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    r = health.checkpoint_dir(inp(checkpoint_dir=blocker / "ckpt"))
    assert not r.ok
    assert r.detail.startswith("not writable")
    assert str(blocker / "ckpt") in str(r.value)


def test_checkpoint_dir_in_tmp_passes_and_leaves_nothing_behind(tmp_path: Path):
    d = tmp_path / "ckpt" / "nested"
    r = health.checkpoint_dir(inp(checkpoint_dir=d, min_free_disk_mb=0))
    assert r.ok, r
    assert d.is_dir() and list(d.iterdir()) == []
    assert "MB free" in str(r.value)


def test_checkpoint_dir_without_enough_free_space_fails(tmp_path: Path):
    r = health.checkpoint_dir(inp(checkpoint_dir=tmp_path, min_free_disk_mb=1e15))
    assert not r.ok and "MB free" in str(r.value)


def test_checkpoint_dir_not_configured_is_skipped():
    r = health.checkpoint_dir(inp())
    assert r.ok and "skipped" in r.detail


def test_checkpoint_dir_is_the_checkpoints_own_unless_health_names_another(tmp_path: Path):
    from resilient.config import load_config

    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    # checkpoint.dir set, health.checkpoint_dir not: its free space is what is checked
    r = health.checkpoint_dir(
        HealthInput.of(
            0, 1, None, load_config(None, checkpoint={"dir": str(ckpt)}, health={"min_free_disk_mb": 1e15})
        )
    )
    assert not r.ok and str(ckpt) in r.value, r
    got = HealthInput.of(
        0, 1, None, load_config(None, checkpoint={"dir": str(ckpt)}, health={"checkpoint_dir": str(other)})
    )
    assert got.checkpoint_dir == other
    assert HealthInput.of(0, 1, None, load_config(None)).checkpoint_dir is None


def test_store_round_trip_passes():
    store = dist.HashStore()
    r = health.store(inp(store=store))
    assert r.ok, r
    assert store.get("health/g4/r1") == b"1"


def test_store_failure_is_reported():
    class DeadStore(dist.HashStore):
        def compare_set(self, key: str, expected: object, desired: object) -> bytes:
            raise RuntimeError("Connection reset by peer")

    r = health.store(inp(store=DeadStore()))
    assert not r.ok and "Connection reset by peer" in r.detail


def test_gpu_check_without_cuda_is_ok():
    r = health.gpu(inp())
    assert r.name == "gpu"
    if not torch.cuda.is_available():
        assert r.ok and r.value == "absent" and "skipped" in r.detail
    else:  # on a GPU machine the NVML query must succeed on a healthy device
        assert r.ok, r


def test_run_checks_counts_a_raising_check_as_failed_with_its_name():
    def disk_latency(_: HealthInput) -> CheckResult:
        raise OSError("iostat missing")

    def always_fine(_: HealthInput) -> CheckResult:
        return CheckResult("always_fine", True, 1)

    results = run_checks(
        inp(store=dist.HashStore(), checks=("host_memory", "store")), [disk_latency, always_fine]
    )
    by_name = {r.name: r for r in results}
    assert [r.name for r in results] == ["host_memory", "store", "disk_latency", "always_fine"]
    bad = by_name["disk_latency"]
    assert not bad.ok and bad.value == "OSError" and "iostat missing" in bad.detail
    assert by_name["always_fine"].ok and by_name["store"].ok


@pytest.mark.parametrize("checks", [(), ("store",)])
def test_run_checks_runs_only_the_configured_builtins(checks):
    results = run_checks(inp(checks=checks))
    assert [r.name for r in results] == list(checks)
