"""A real Prometheus server scrapes `resilient launch --metrics-port` through real faults; what
PromQL answers must equal what the run's event log says."""

from __future__ import annotations

import collections
import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from resilient.metrics import account
from tests._wait import wait_until
from tests.integration.conftest import assert_bit_exact, load_states, run_example
from tests.integration.test_launcher import _example

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> Any:
        q = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{q}", timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def vector(self, query: str, label: str) -> dict[str, float]:
        return {
            s["metric"].get(label, ""): float(s["value"][1])
            for s in self.get("/api/v1/query", query=query)["result"]
        }


@contextlib.contextmanager
def prometheus(workdir: Path, target: str) -> Iterator[Prometheus]:
    """Debian's prometheus on 127.0.0.1, scraping ``target`` every second, with our alert rules."""
    workdir.mkdir(parents=True)
    shutil.copy(ROOT / "configs" / "prometheus" / "alerts.yml", workdir / "alerts.yml")
    (workdir / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "rule_files: [alerts.yml]\n"
        f"scrape_configs: [{{job_name: resilient, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    port = _free_port()
    log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed below
    p = subprocess.Popen(
        [PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    prom = Prometheus(port)

    def ready() -> bool:
        assert p.poll() is None, (workdir / "prometheus.log").read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_until(ready, 30, "prometheus ready")
        yield prom
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian's prometheus package)")
def test_prometheus_sees_the_faults_restarts_and_goodput_the_log_records(tmp_path: Path) -> None:
    port = _free_port()
    with prometheus(tmp_path / "prom", f"127.0.0.1:{port}") as prom:
        metrics = ("--metrics-port", str(port), "--metrics-addr", "127.0.0.1", "--metrics-linger", "3")
        # an exception on rank 1 (recovered in-process), then a GIL-holding hang on rank 1 (its
        # heartbeat stops: the agent replaces it), with a step record per step
        run = _example(tmp_path / "job", "--fault", "exception@5:1,gil_hang@14:1", "--fault-attempt", "0",
                       replace="rank", launch=metrics)  # fmt: skip
        try:
            rc = run.finish()
        finally:
            if run.p.poll() is None:
                run.finish(timeout=1)
        assert rc == 0, run.output()
        events = run.events()
        acc = account(events)
        kinds = collections.Counter(i.kind for i in acc.incidents)
        modes = collections.Counter(i.mode for i in acc.incidents)
        assert kinds == {"exception": 1, "no_heartbeat": 1}, [vars(i) for i in acc.incidents]
        assert modes == {"in_process": 1, "replacement": 1}

        rng = "[10m]"
        faults = prom.vector(f"sum by (kind) (max_over_time(resilient_faults_total{rng}))", "kind")
        assert faults == {k: float(n) for k, n in kinds.items()}
        restarts = prom.vector(f"max_over_time(resilient_restarts_total{rng})", "mode")
        assert restarts == {"in_process": 1.0, "replacement": 1.0, "relaunch": 0.0}
        goodput = prom.vector(f"last_over_time(resilient_goodput_ratio{rng})", "run_id")
        assert list(goodput.values()) == [pytest.approx(acc.goodput, rel=1e-9)]
        by_cause = prom.vector(f"last_over_time(resilient_time_seconds{rng})", "cause")
        assert by_cause == {c: pytest.approx(s, rel=1e-9, abs=1e-9) for c, s in acc.seconds.items()}
        assert sum(by_cause.values()) == pytest.approx(acc.wall_s, rel=1e-9)
        state = prom.vector(f"last_over_time(resilient_run_state{rng}) == 1", "state")
        assert list(state) == ["finished"]
        recover = prom.vector(f"max_over_time(resilient_recovery_seconds_count{rng})", "mode")
        assert recover == {"in_process": 1.0, "replacement": 1.0, "relaunch": 0.0}
        last = prom.get("/api/v1/query", query=f"last_over_time(resilient_last_fault_info{rng})")["result"]
        # (the endpoint recomputes at most every 5 s: a fault that was the newest for less may
        # never be scraped as such; the labels of one fault change as it is learnt, e.g. its mode)
        seen = {(r["metric"]["kind"], r["metric"]["rank"]) for r in last}
        assert ("no_heartbeat", "1") in seen and seen <= {("exception", "1"), ("no_heartbeat", "1")}, last
        newest = prom.vector(f"last_over_time(resilient_last_fault_timestamp_seconds{rng})", "run_id")
        assert list(newest.values()) == [pytest.approx(acc.incidents[-1].start, abs=1e-3)]
        steps = prom.vector(f"max_over_time(resilient_step{rng})", "rank")
        assert set(steps) == {"0", "1"} and min(steps.values()) >= acc.steps - 1
        rules = prom.get("/api/v1/rules")["groups"][0]["rules"]
        shipped = (ROOT / "configs" / "prometheus" / "alerts.yml").read_text().count("- alert:")
        assert len(rules) == shipped == 8 and all(r["health"] == "ok" for r in rules), rules

    reports = [e for e in events if e["event"] == "fault_report"]
    exc = [r for r in reports if r.get("kind") == "exception"]
    assert exc and "InjectedFault" in exc[0]["traceback"], "the user's traceback is in the fault report"
    if shutil.which("py-spy") or Path(sys.executable).with_name("py-spy").exists():
        silent = [r for r in reports if r.get("source") == "py-spy"]
        assert silent and "inject.py" in silent[0]["stacks"] and "active+gil" in silent[0]["stacks"], silent


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            return str(r.read().decode())
    except OSError:
        return None


def _faults(text: str) -> list[tuple[str, str, float]]:
    """(kind, rank, count) of each fault series an endpoint served."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    return [
        (s.labels["kind"], s.labels["rank"], s.value) for s in samples if s.name == "resilient_faults_total"
    ]


def test_under_torchrun_local_rank_0_serves_and_a_fault_shows(tmp_path: Path, reference: Any) -> None:
    """`metrics.port` in the config, env:// ranks: rank 0 serves the run's metrics while it trains."""
    port = _free_port()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"metrics: {{port: {port}, addr: 127.0.0.1, refresh_s: 0.1}}\n")
    seen: list[str] = []

    def scrape_while_running(procs: list[subprocess.Popen[str]]) -> None:
        def faulted() -> bool:
            text = _scrape(port)
            if text is not None:
                seen.append(text)
            assert any(p.poll() is None for p in procs), "the ranks ended before the fault showed"
            return text is not None and ("exception", "1", 1.0) in _faults(text)

        wait_until(faulted, 60, "the exception in the endpoint's fault count")

    res = run_example(tmp_path, 2, "--config", str(cfg), "--fault", "exception@8:1", "--step-ms", "100",
                      on_start=scrape_while_running)  # fmt: skip
    assert res.ok, res.describe()
    assert _faults(seen[-1]) == [("exception", "1", 1.0)]
    assert all("cannot serve" not in r.stderr for r in res.ranks), "only local rank 0 serves"
    states = load_states(tmp_path, 2)
    for rank in range(2):
        assert assert_bit_exact(reference[2][rank]["model"], states[rank]["model"]) > 20


def test_a_taken_port_and_no_scraper_leave_training_untouched(tmp_path: Path, reference: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(f"metrics: {{port: {port}, addr: 127.0.0.1}}\n")
        res = run_example(tmp_path, 2, "--config", str(cfg), "--fault", "exception@8:1")
    assert res.ok, res.describe()
    warned = [ln for ln in res.ranks[0].stderr.splitlines() if "cannot serve on 127.0.0.1" in ln]
    assert len(warned) == 1 and "training is not affected" in warned[0], res.ranks[0].stderr[-3000:]
    states = load_states(tmp_path, 2)
    for rank in range(2):
        assert assert_bit_exact(reference[2][rank]["model"], states[rank]["model"]) > 20
