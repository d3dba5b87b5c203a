"""A real Slurm cluster on this machine: munged, MariaDB, slurmdbd, slurmctld and three slurmd.

Debian's ``slurmd`` is built with multiple-slurmd support: ``slurmd -N n1`` ... ``slurmd -N n3``
are three nodes of one host, each on its own port (``NodeName=n1 NodeAddr=127.0.0.1 Port=...``).
Every daemon runs in the foreground as a child of the test process, with its state, sockets and
logs in one temporary directory and every port a free loopback one, so two clusters (two
engineers' test runs) on one machine do not meet. ``sacct`` works: slurmdbd stores the
controller's accounting in a MariaDB server of its own (an empty data directory, no grant
tables, loopback only), which shows a requeued job's earlier runs (``sacct -D``). Jobs go to
partition ``debug`` (two nodes, a third idle for a job requeued off a lost node); a job in
``urgent`` preempts them (PreemptMode=REQUEUE), as a site's high-priority partition does.

The ``slurm_cluster`` fixture (one cluster per session) installs Debian's packages where they
are missing (root only), starts everything and waits until every node is idle; it skips, with
the reason, where Slurm cannot be installed or a daemon exits at start. Teardown (also after a
failed test) kills every job, stops the daemons and then kills any process still carrying the
cluster's ``SLURM_CONF``: slurmstepd inherits it from slurmd, and every job task, launcher and
worker from ``sbatch``'s environment.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from chaos.harness import free_port
from tests._wait import wait_until

NODES = ("n1", "n2", "n3")
CPUS_PER_NODE = 2  # (both nodes are this machine's cores: the figure only sizes allocations)
PACKAGES = ("slurm-wlm", "slurmdbd", "munge", "mariadb-server-core")
# the programs the cluster runs, each with the Debian package that brings it
PROGRAMS = {
    "munged": "munge", "munge": "munge", "mariadbd": "mariadb-server-core", "slurmdbd": "slurmdbd",
    "slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "sacct": "slurm-client",
}  # fmt: skip
SBIN = "/usr/local/sbin:/usr/sbin:/sbin"  # (daemons live there; a non-login PATH may lack it)
START_TIMEOUT = 60.0  # per daemon, on a loaded 2-core machine
STOP_TIMEOUT = 20.0
PREEMPT_GRACE_S = 30
JOB_DONE = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE",
})  # fmt: skip


class ClusterUnavailable(Exception):
    """Slurm cannot be installed or started on this machine: the tests that need it skip."""


def _path() -> str:
    return f"{os.environ.get('PATH', '')}:{SBIN}"


def _missing() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p, path=_path()) is None]


def install(timeout: float = 600.0) -> None:
    """Debian's packages, where a program is missing (``apt-get update`` only if the first try
    fails, as .ci/run does); raises ClusterUnavailable saying why it cannot."""
    missing = _missing()
    if not missing:
        return
    why = f"Slurm is not installed ({', '.join(missing)} missing)"
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"{why} and installing it needs root")
    if shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"{why} and there is no apt-get to install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=timeout)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip()[-500:]
        raise ClusterUnavailable(f"{why}; `{' '.join(cmd)}` failed (exit {r.returncode}): {tail}")
    if _missing():
        raise ClusterUnavailable(f"{why}; still missing after `{' '.join(cmd)}`: {', '.join(_missing())}")


def slurm_conf(root: Path, ports: dict[str, int], first_job_id: int, nodes: Sequence[str] = NODES) -> str:
    """slurm.conf for ``nodes`` on this host; the reason for each unusual line is beside it."""
    munge = root / "munge.sock"
    lines = [
        "ClusterName=resilient",
        # slurmctld refuses to start unless one SlurmctldHost is this host's short name
        f"SlurmctldHost={os.uname().nodename.split('.')[0]}(127.0.0.1)",
        f"SlurmctldPort={ports['slurmctld']}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # our own munged; cred_expire is also how long a requeued job waits (default 120 s)
        f"AuthInfo=socket={munge},cred_expire=10",
        f"StateSaveLocation={root / 'ctld'}",
        f"SlurmdSpoolDir={root / 'spool' / '%n'}",  # (%n: each slurmd its own)
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
        "MailProg=/bin/true",
        # linuxproc tracks a step's processes by their parents, as proctrack/cgroup does on a real
        # site: torch's workers run in sessions of their own, which proctrack/pgid would miss
        # (neither signalled nor cleaned up). No cgroup is needed: two slurmd share this host.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/linux",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=127.0.0.1",
        f"AccountingStoragePort={ports['slurmdbd']}",
        f"AccountingStoragePass={munge}",  # (the munge socket for slurmdbd: AuthInfo's is not used)
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=2",  # a requeued job starts once its wait is over
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",  # (the nodes' CPUs below are not the hardware's)
        "ReturnToService=2",  # a node whose slurmd comes back is usable again
        "SlurmdTimeout=30",  # a killed slurmd: its node is DOWN within ~30 s
        "KillWait=30",  # SIGTERM -> SIGKILL at a job's end (a requeue's grace): the default
        # a job in a partition of a higher PriorityTier requeues the jobs it needs the nodes of
        "PreemptType=preempt/partition_prio",
        "PreemptMode=REQUEUE",
        "InactiveLimit=0",
        "MinJobAge=600",  # finished jobs stay in `scontrol show job` for the tests to read
        f"FirstJobId={first_job_id}",  # (random: run ids and /dev/shm names differ across clusters)
    ]
    for name in nodes:
        lines.append(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[name]} "
            f"CPUs={CPUS_PER_NODE} Boards=1 SocketsPerBoard=1 CoresPerSocket={CPUS_PER_NODE} "
            "ThreadsPerCore=1 RealMemory=2000 State=UNKNOWN"
        )
    every = ",".join(nodes)
    # GraceTime: a preempted job has that long after its SIGTERM (a site's notice period)
    lines.append(f"PartitionName=debug Nodes={every} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
                 f"GraceTime={PREEMPT_GRACE_S}")  # fmt: skip
    lines.append(f"PartitionName=urgent Nodes={every} MaxTime=INFINITE State=UP PriorityTier=10 "
                 "PreemptMode=OFF")  # fmt: skip
    return "\n".join(lines) + "\n"


def slurmdbd_conf(root: Path, ports: dict[str, int]) -> str:
    return "\n".join([
        "AuthType=auth/munge",
        f"AuthInfo=socket={root / 'munge.sock'}",
        "DbdHost=localhost",
        "DbdAddr=127.0.0.1",
        f"DbdPort={ports['slurmdbd']}",
        "SlurmUser=root",
        f"LogFile={root / 'log' / 'slurmdbd.log'}",
        f"PidFile={root / 'slurmdbd.pid'}",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={ports['mariadb']}",
        "StorageUser=root",
        "StorageLoc=slurm_acct_db",
    ]) + "\n"  # fmt: skip


class SlurmCluster:
    """The daemons of one cluster under ``root``, its clients, and its teardown (``close``)."""

    def __init__(self, root: Path, nodes: Sequence[str] = NODES) -> None:
        self.root, self.nodes = root, tuple(nodes)
        self.conf = root / "slurm.conf"
        self.ports = {name: free_port() for name in ("slurmctld", "slurmdbd", "mariadb", *self.nodes)}
        self.first_job_id = random.randint(100_000, 899_999)
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": _path()}
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        self.jobs: list[int] = []
        self.closed = False

    # --- start ---------------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        """Every daemon, each waited for in turn; ClusterUnavailable where one exits at start."""
        if len(str(self.root / "munge.sock")) > 100:  # (a unix socket's path: 108 bytes at most)
            raise ClusterUnavailable(f"the cluster's directory is too deep for a socket: {self.root}")
        for sub in ("log", "ctld", "db", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)  # (munged refuses a key others could read)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(slurm_conf(self.root, self.ports, self.first_job_id, self.nodes))
        dbd = self.root / "slurmdbd.conf"  # (slurmdbd reads it beside SLURM_CONF; 0600 or it refuses)
        dbd.write_text(slurmdbd_conf(self.root, self.ports))
        dbd.chmod(0o600)
        sock = str(self.root / "munge.sock")
        self._spawn("munged", "munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
                    f"--pid-file={self.root / 'munged.pid'}", f"--seed-file={self.root / 'munge.seed'}",
                    f"--log-file={self.root / 'log' / 'munged.log'}", "--num-threads=2")  # fmt: skip
        self._wait("munged", lambda: self._ok("munge", "-S", sock, "-n", "-o", os.devnull))
        db = self.root / "db"
        self._spawn("mariadb", "mariadbd", "--no-defaults", f"--datadir={db}", f"--socket={db / 'sock'}",
                    f"--port={self.ports['mariadb']}", "--bind-address=127.0.0.1", "--user=root",
                    "--skip-grant-tables", "--skip-log-bin", f"--pid-file={db / 'pid'}",
                    f"--log-error={self.root / 'log' / 'mariadb.log'}", "--innodb-log-file-size=8M",
                    "--innodb-lock-wait-timeout=900")  # fmt: skip
        self._wait("mariadb", lambda: "ready for connections" in self._log("mariadb.log"))
        self._spawn("slurmdbd", "slurmdbd", "-D")
        self._wait("slurmdbd", lambda: self._ok("sacctmgr", "-n", "-P", "show", "cluster"))
        self._spawn("slurmctld", "slurmctld", "-D")
        self._wait("slurmctld", lambda: "is UP" in self.run("scontrol", "ping", check=False).stdout)
        for node in self.nodes:
            self._spawn(f"slurmd {node}", "slurmd", "-D", "-N", node)
        self._wait("slurmd", lambda: set(self.node_states().values()) == {"idle"})
        return self

    def _spawn(self, name: str, *argv: str) -> None:
        log = open(self.root / "log" / f"{name.replace(' ', '-')}.out", "wb")  # noqa: SIM115
        with log:  # (the child holds its own copy)
            self.daemons[name] = subprocess.Popen(
                argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.root, start_new_session=True,
            )  # fmt: skip

    def _wait(self, what: str, ready: Any) -> None:
        def up() -> bool:
            for name, p in self.daemons.items():
                if p.poll() is not None:
                    raise ClusterUnavailable(f"{name} exited with {p.returncode} at start:\n{self.logs()}")
            return bool(ready())

        wait_until(up, START_TIMEOUT, lambda: f"{what} to be ready:\n{self.logs()}", interval=0.1)

    def _ok(self, *argv: str) -> bool:
        return subprocess.run(argv, env=self.env, capture_output=True, timeout=30).returncode == 0

    # --- clients -------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A Slurm client (sinfo, srun, scontrol, ...) against this cluster."""
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {r.returncode}\n{r.stderr}\n{self.logs()}")
        return r

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def sbatch(self, script: str | Path, *args: str, cwd: Path, options: Sequence[str] = (),
               env: dict[str, str] | None = None) -> int:  # fmt: skip
        """Submit ``script args...`` from ``cwd`` (its environment: ours plus ``env``); the job id."""
        cwd.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["sbatch", "--parsable", *options, str(script), *args],
            env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert r.returncode == 0, f"sbatch: exit {r.returncode}: {r.stderr}"
        job = int(r.stdout.strip().split(";")[0])
        self.jobs.append(job)
        return job

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, NodeList, Restarts, ...)."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """The job's fields once it has ended (a requeued job runs again before it ends)."""

        def ended() -> dict[str, str] | None:
            info = self.job(job_id)
            return info if info["JobState"] in JOB_DONE else None

        return wait_until(ended, timeout, lambda: f"job {job_id} to end: {self.job(job_id)}\n{self.logs()}",
                          interval=0.5)  # fmt: skip

    def sacct(
        self, job_id: int, fields: str = "JobID,JobName,State,ExitCode,NodeList,NTasks", *extra: str
    ) -> list[dict[str, str]]:
        """The accounting rows of every run of the job (``-D``: a requeued job's earlier runs too;
        ``extra``: more of sacct's flags, ``-X`` for the allocations alone)."""
        out = self.run("sacct", "-D", "-n", "-P", *extra, "-j", str(job_id), "-o", fields).stdout
        keys = fields.split(",")
        return [dict(zip(keys, line.split("|"), strict=True)) for line in out.splitlines() if line]

    def lose_node(self, node: str) -> int:
        """``node`` as if it lost power: its slurmd and every process of its job steps (slurmstepd,
        the tasks and what they started), stopped together and then killed; how many processes."""
        daemon = self.daemons[f"slurmd {node}"]
        tasks = [p for p in self.leftovers() if _environ(p.pid).get(b"SLURMD_NODENAME") == node.encode()]
        stepds = {q for p in tasks if (q := _parent(p)) is not None and q.name().startswith("slurmstepd")}
        doomed = {psutil.Process(daemon.pid), *stepds}
        for p in [*tasks, *stepds]:
            with contextlib.suppress(psutil.Error):
                doomed |= {p, *p.children(recursive=True)}
        for sig in (signal.SIGSTOP, signal.SIGKILL):  # (stopped first: none of them notices the others go)
            for p in doomed:
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
        daemon.wait(STOP_TIMEOUT)
        return len(doomed)

    def restore_node(self, node: str, timeout: float = START_TIMEOUT) -> None:
        """A lost node's slurmd started again; back once the controller has it idle (ReturnToService)."""
        self._spawn(f"slurmd {node}", "slurmd", "-D", "-N", node)
        self.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)  # (if DOWN still)
        wait_until(lambda: self.node_states().get(node) == "idle", timeout, f"{node} to be idle again",
                   interval=0.5)  # fmt: skip

    def logs(self, lines: int = 15) -> str:
        """The tail of every daemon's log (for failure messages)."""
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            tail = f.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {f.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def _log(self, name: str) -> str:
        with contextlib.suppress(FileNotFoundError):
            return (self.root / "log" / name).read_text(errors="replace")
        return ""

    # --- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every job, stop every daemon, then kill what is left of the cluster; idempotent."""
        if self.closed:
            return
        self.closed = True
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            # (SIGKILL: a job's own SIGTERM handling would hold the teardown for KillWait)
            self.run("scancel", "--full", "--signal=KILL", "--partition=debug", check=False)
            self.run("scancel", "--partition=debug", check=False)
            with contextlib.suppress(pytest.fail.Exception):  # (the sweep below kills what is left)
                wait_until(lambda: not self.run("squeue", "-h", check=False).stdout.strip(), 30.0, "no jobs")
        for name in reversed(list(self.daemons)):  # nodes, controller, accounting, its DB, munged
            p = self.daemons[name]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for p in self.leftovers():  # slurmstepd, job tasks: started by the daemons, not children of ours
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(self.leftovers(), timeout=STOP_TIMEOUT)
        for job in self.jobs:  # a launcher killed by SIGKILL leaves its heartbeats and snapshots
            for left in Path("/dev/shm").glob(f"resilient-*slurm-{job}-*"):
                shutil.rmtree(left, ignore_errors=True)

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this cluster still alive: every one carries its SLURM_CONF."""
        mine = f"SLURM_CONF={self.conf}".encode()
        found = []
        for p in psutil.process_iter():
            if p.pid == os.getpid():
                continue
            try:  # (the raw file: psutil's environ() drops entries it cannot parse)
                with open(f"/proc/{p.pid}/environ", "rb") as f:
                    if mine in f.read().split(b"\0"):
                        found.append(p)
            except OSError:
                continue
        return found

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _environ(pid: int) -> dict[bytes, bytes]:
    """A process's environment (the raw file: psutil's environ() drops entries it cannot parse)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


def _parent(p: psutil.Process) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):
        return p.parent()
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running two-node cluster (n1, n2; idle), shared by the session's tests; torn down at its
    end, whatever the tests did. Skips, with the reason, where Slurm cannot be installed or started."""
    if not os.path.isdir("/proc") or os.geteuid() != 0:
        pytest.skip("a Slurm cluster here needs Linux and root (slurmd runs jobs as their users)")
    try:
        install()
    except (ClusterUnavailable, subprocess.TimeoutExpired) as e:
        pytest.skip(str(e))
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        try:
            cluster.start()
        except ClusterUnavailable as e:
            pytest.skip(str(e))
        yield cluster
