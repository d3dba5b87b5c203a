"""``resilient launch``: torchrun's command line, torch.distributed.elastic's agent and c10d rendezvous,
plus heartbeats, fault causes and exit codes a scheduler can act on.

Every torchrun flag is accepted (the parser *is* torchrun's); ours are added to it:
``--heartbeat-timeout`` (a worker silent this long is killed and the group relaunched),
``--startup-timeout`` (the same before its first beat), ``--backoff-initial``/``--backoff-max``,
``--max-replacements`` (dead ranks replaced alone). One default differs from torchrun's:
``--max-restarts`` is 3, not 0, since a job launched here is meant to outlive its faults.
``--help`` shows every default.

Exit codes: 0 every worker finished; 76 (REQUEUE) a worker was preempted and wrote its final
checkpoint (SIGUSR1/SIGTERM to the launcher are forwarded to the workers as SIGUSR1); 3 (FATAL)
a worker gave up (fault repeats, budget spent) or restarts were exhausted — do not requeue;
75 (HARD_FAULT) this node failed its health checks ``--max-health-failures`` times and left the
job, which goes on without it — repair or replace the node.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

from resilient import PYNVML_NOISE
from resilient.argtypes import count, nonnegative, positive
from resilient.checkpoint.shm import ShmSnapshot
from resilient.contract import heartbeat_dir
from resilient.errors import ExitCode
from resilient.events import Event, EventLog
from resilient.launch_env import SlurmPlace, Var
from resilient.launcher.agent import ResilientAgent
from resilient.launcher.elastic import Elastic
from resilient.launcher.policy import LaunchConfig, LaunchPolicy, Replace
from resilient.launcher.seats import store_endpoint
from resilient.native import names

_DEFAULT = LaunchConfig()  # (the launcher's budgets and schedule: their defaults live there)


def parser() -> Any:
    """torchrun's parser, its ``--max-restarts`` default ours, and the launcher's own flags."""
    p = get_args_parser()
    p.prog = "resilient launch"
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.set_defaults(max_restarts=_DEFAULT.max_restarts)
    for action in p._actions:  # (torchrun's help text for the one default changed here)
        if action.dest == "max_restarts":
            action.help = (
                "restarts of the whole worker group before the launcher gives up (exit 3); a dead "
                "rank replaced alone draws on --max-replacements instead (torchrun's default: 0)"
            )
    _add_liveness(p)
    _add_budgets(p)
    _add_membership(p)
    _add_replacement(p)
    _add_outputs(p)
    return p


def _add_liveness(p: argparse.ArgumentParser) -> None:
    """When a worker that beats no more counts as dead."""
    p.add_argument(
        "--heartbeat-timeout",
        type=positive,
        default=30.0,
        help="seconds without a worker heartbeat before it is killed and the group relaunched",
    )
    p.add_argument(
        "--startup-timeout", type=positive, default=300.0, help="the same, before a worker's first beat"
    )


def _add_budgets(p: argparse.ArgumentParser) -> None:
    """What the deaths of a job may cost before the launcher gives up, and how relaunches are paced."""
    p.add_argument(
        "--backoff-initial",
        type=nonnegative,
        default=_DEFAULT.backoff_initial_s,
        help="delay before the 2nd relaunch, s",
    )
    p.add_argument(
        "--backoff-max",
        type=nonnegative,
        default=_DEFAULT.backoff_max_s,
        help="cap of the exponential backoff, s",
    )
    p.add_argument(
        "--restart-window",
        type=positive,
        default=_DEFAULT.restart_window_s,
        help="count only the group restarts of the last this-many seconds against --max-restarts "
        "(None: every restart of the job, as torchrun)",
    )
    p.add_argument(
        "--max-replacements",
        type=count(0, 10**6),
        default=_DEFAULT.max_replacements,
        help="dead ranks replaced alone (--replace rank) within --replacement-window before a death "
        "restarts the whole group instead; the runtime's in-process budget is its config's "
        "restart.max_recoveries",
    )
    p.add_argument(
        "--replacement-window",
        type=positive,
        default=_DEFAULT.replacement_window_s,
        help="count only the replacements of the last this-many seconds against --max-replacements",
    )
    p.add_argument(
        "--max-repeats",
        type=count(1, 10**6),
        default=_DEFAULT.max_repeats,
        help="a rank dying at the same step this many launches in a row stops the job (exit 3)",
    )


def _add_membership(p: argparse.ArgumentParser) -> None:
    """Which nodes run the job: one that joins it, one that fails its health checks."""
    p.add_argument(
        "--admit-waiting",
        action="store_true",
        help="restart a healthy group to admit a node that joins (torchrun's behaviour); by default "
        "it waits as a spare and joins at the next restart",
    )
    p.add_argument(
        "--max-health-failures",
        type=count(1, 10**6),
        default=_DEFAULT.max_health_failures,
        help="restarts caused by a failed health check on this node before it leaves the job (exit 75)",
    )


def _add_replacement(p: argparse.ArgumentParser) -> None:
    """How a dead rank is replaced, and what is kept of a dying worker (its stacks, its snapshots)."""
    p.add_argument(
        "--replace",
        choices=tuple(r.value for r in Replace),
        default=_DEFAULT.replace.value,
        help="a worker that dies while training: 'rank' replaces it alone and its survivors recover "
        "in their processes (the whole group restarts where that cannot work); 'group' restarts "
        "every worker, as torchrun",
    )
    p.add_argument(
        "--standby",
        type=count(0, 4096),
        default=1,
        help="warm standby processes per node that take a dead rank's place with --replace rank; "
        "0: a new process each time",
    )
    p.add_argument(
        "--standby-mode",
        choices=("park", "import"),
        default="park",
        help="park: a standby runs the script's imports and top level and waits in its "
        "resilient.wrap call (it falls back to import, with a standby_fallback event, where the top "
        "level reads a rank); import: it imports torch and the runtime only",
    )
    p.add_argument(
        "--native-stacks",
        action="store_true",
        help="a silent worker's stack dump (py-spy, before it is killed) holds its C frames too; it "
        "then takes ~0.3 s more with torch loaded, which delays its replacement",
    )
    p.add_argument(
        "--flush-timeout",
        type=positive,
        default=300.0,
        help="with checkpoint.flush_on_death in the workers' config: how long this agent, giving up, "
        "waits for its ranks' snapshots to reach checkpoint.dir before the shared memory goes",
    )


def _add_outputs(p: argparse.ArgumentParser) -> None:
    """What the launch writes and serves (events, metrics), and the faults it fires on purpose."""
    p.add_argument(
        "--events-dir",
        type=Path,
        default=None,
        help="<dir>/<run_id>/events.jsonl, the agent's and the workers' (default: resilient_runs, the "
        "workers' as their config's events.dir says)",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        help="serve this node's Prometheus metrics on this port (faults, restarts, goodput, "
        "checkpoints, heartbeats; from the event log and heartbeats); 0: a free port",
    )
    p.add_argument("--metrics-addr", default="0.0.0.0", help="the address --metrics-port binds to")
    p.add_argument(
        "--fault",
        action="append",
        default=None,
        metavar="KIND@STEP[:RANK]",
        help="fire a real fault in the script's own step (comma-separated or repeated; the chaos "
        "harness's plan: kind@step[:rank][=arg][xN], e.g. exception@12:1, hang@20:0, oom@8:1, "
        "segfault@15:1; `chaos kinds` lists the kinds); each fires once per job",
    )
    p.add_argument(
        "--metrics-linger",
        type=nonnegative,
        default=0.0,
        help="seconds the endpoint keeps serving the final figures after the job ends (a last scrape)",
    )


def _port(text: str) -> int:
    import argparse

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {port} (0-65535)")
    return port


def _forward_preemption(agent: ResilientAgent) -> None:
    """SIGUSR1/SIGTERM to the launcher (Slurm's warning, a preemption): ask workers for a final
    checkpoint with SIGUSR1; they exit with 76 and the launcher with them."""

    def forward(signum: int, _frame: Any) -> None:
        logger.info(f"launcher got {signal.Signals(signum).name}: forwarding SIGUSR1 to the workers")
        for w in agent.workers():
            if isinstance(w.id, int):
                try:
                    os.kill(w.id, signal.SIGUSR1)
                except ProcessLookupError:
                    continue

    agent.forward_signals = forward


FAULT_PLANS = "resilient.fault_plans"  # the entry point group the chaos harness registers in


def fault_plan(p: argparse.ArgumentParser, plan: str, injections: Path) -> dict[str, str]:
    """The workers' environment that fires ``plan`` (``--fault``), from the harness registered
    under :data:`FAULT_PLANS`; a plan that does not parse is a usage error naming it."""
    from importlib.metadata import entry_points

    found = list(entry_points(group=FAULT_PLANS))
    if not found:
        p.error(f"argument --fault: no fault harness is installed (entry point group {FAULT_PLANS})")
    try:
        env: dict[str, str] = found[0].load()(plan, str(injections), os.environ)
    except ValueError as e:
        p.error(f"argument --fault: {e}")
    return env


_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")  # torchrun's own: one worker per device of that kind


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, Any]:
    """The command line, with the values torchrun's config would only refuse by a traceback
    refused here as usage errors (exit 2, one line naming the flag and the value)."""
    p = parser()
    args = p.parse_args(argv)
    n = str(args.nproc_per_node)
    if n not in _NPROC_WORDS and not (n.isdigit() and int(n) >= 1):
        words = ", ".join(_NPROC_WORDS)
        p.error(f"argument --nproc-per-node: expected a number >= 1 or one of {words}, got {n!r}")
    try:
        parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError) as e:
        p.error(f"argument --nnodes: {args.nnodes!r}: {e}")
    return args, p


def _workers_environ(
    args: argparse.Namespace, p: argparse.ArgumentParser, run_id: str, hb_dir: Path, shm_name: str
) -> None:
    """What the workers inherit from this process's environment (the contract, launch_env.py);
    ``args.events_dir`` is set to where the events go."""
    # a worker's script imports torch before us: the pynvml shim's warning is filtered for it here
    quiet = f"ignore:{PYNVML_NOISE}:FutureWarning"
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), quiet]))
    os.environ[Var.HEARTBEAT_DIR] = str(hb_dir)
    os.environ[Var.LAUNCHER_PID] = str(os.getpid())  # workers die with the launcher (PDEATHSIG)
    os.environ[Var.HEARTBEAT_INTERVAL] = str(max(0.05, min(1.0, args.heartbeat_timeout / 5)))
    os.environ[Var.RUN_ID] = run_id
    if args.events_dir is not None:  # the workers' logs beside the agent's
        os.environ[Var.EVENTS_DIR] = str(args.events_dir.resolve())
    else:
        args.events_dir = Path("resilient_runs")
    os.environ[Var.PREEMPT_SIGNALS] = "SIGUSR1"  # SIGTERM from the agent means "stop now"
    if args.fault:
        injections = (args.events_dir / run_id / "injections.jsonl").resolve()
        os.environ.update(fault_plan(p, ",".join(args.fault), injections))
    os.environ[Var.SHM_NAME] = shm_name  # workers snapshot there; kept across relaunches


@dataclass(frozen=True)
class _Job:
    """This node's launch: the job's run id, and where its heartbeats, snapshots and events go."""

    run_id: str
    heartbeat_dir: Path
    shm_name: str
    events: Path  # the agent's and the workers' event log
    slurm: SlurmPlace | None  # (srun's task: the agent's events name its node too)

    @property
    def where(self) -> dict[str, Any]:
        return self.slurm.fields() if self.slurm is not None else {}


def main(argv: list[str] | None = None) -> int:
    args, p = parse(argv)
    if os.environ.get(Var.STORE_NAME_LOOKUPS) != "1":
        # the workers' store is served from this process: no accept may wait for a name server
        names.apply_or_warn()
    config, cmd, cmd_args = _elastic_config(args, p)
    job = _job(args, p, config.run_id)
    events = EventLog(job.events, rank=-1, **job.where)
    spec = _worker_spec(config, cmd, cmd_args)
    agent = _agent(args, config, spec, job, events)
    exporter = _exporter(args, job, agent)
    result = None
    lost: RendezvousConnectionError | None = None
    try:
        result = agent.run()
    except RendezvousConnectionError as e:
        lost = e
    finally:
        _wind_up(args, config, spec, job, agent, events, exporter, result)
    if lost is not None:
        return _store_lost(args, job, lost)
    return _exit_code(args, config, job, agent, result)


STORE_LOST = 74  # the launcher's exit: the job's rendezvous store is gone (docs/launcher.md)


def _store_lost(args: argparse.Namespace, job: _Job, e: RendezvousConnectionError) -> int:
    """The rendezvous store went with the node that hosts it: no node can rejoin the job. Said
    on stderr and as ``run_failed``; the exit tells the scheduler to requeue the job (it resumes
    from its newest checkpoint)."""
    why = f"{e.__cause__ or e}".splitlines()[0]
    msg = (
        f"resilient launch: the job's rendezvous store ({args.rdzv_endpoint}) is unreachable: {why}. "
        "The node that hosts it was lost (or the network to it): this node cannot rejoin the job; "
        "requeue it, it resumes from its newest checkpoint"
    )
    with EventLog(job.events, rank=-1, **job.where) as log:
        log.emit(Event.RUN_FAILED, generation=0, step=None, error=msg, exitcode=STORE_LOST)
    print(msg, file=sys.stderr)
    return STORE_LOST


def _elastic_config(args: argparse.Namespace, p: argparse.ArgumentParser) -> tuple[Any, Any, list[str]]:
    """torchrun's launch config, command and arguments from the command line (a run id chosen
    where none is given)."""
    if args.standalone or (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and parse_min_max_nnodes(args.nnodes)[1] == 1
    ):  # as torchrun: a c10d rendezvous on a free local port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", uuid.uuid4().hex[:12]
    if args.master_port is None:
        args.master_port = 29500
    try:
        config, cmd, cmd_args = config_from_args(args)
    except ValueError as e:  # (torchrun's own checks of the rest)
        p.error(str(e))
    if not config.run_id or config.run_id == "none":
        config.run_id = uuid.uuid4().hex[:12]
    return config, cmd, cmd_args


def _job(args: argparse.Namespace, p: argparse.ArgumentParser, run_id: str) -> _Job:
    """This launch's names and places, and the workers' environment that tells them."""
    hb_dir = heartbeat_dir(run_id, os.getpid())
    shm_name = f"{run_id}-{os.getpid()}"
    _workers_environ(args, p, run_id, hb_dir, shm_name)
    return _Job(
        run_id, hb_dir, shm_name, args.events_dir / run_id / "events.jsonl", SlurmPlace.from_environ()
    )


def _worker_spec(config: Any, cmd: Any, cmd_args: list[str]) -> WorkerSpec:
    """torch elastic's spec of this node's workers, on the rendezvous the command line names."""
    rdzv = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = Elastic.master_address(rdzv)
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=cmd,
        args=tuple(cmd_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
    )


def _agent(
    args: argparse.Namespace, config: Any, spec: WorkerSpec, job: _Job, events: EventLog
) -> ResilientAgent:
    """The agent, its policy's budgets and schedule from the command line."""
    policy = LaunchPolicy(
        LaunchConfig(
            replace=args.replace,
            max_restarts=config.max_restarts,
            restart_window_s=args.restart_window,
            max_repeats=args.max_repeats,
            max_health_failures=args.max_health_failures,
            max_replacements=args.max_replacements,
            replacement_window_s=args.replacement_window,
            backoff_initial_s=args.backoff_initial,
            backoff_max_s=args.backoff_max,
        )
    )
    agent = ResilientAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        policy=policy,
        heartbeat_dir=job.heartbeat_dir,
        heartbeat_timeout=args.heartbeat_timeout,
        startup_timeout=args.startup_timeout,
        events=events,
        standby=max(0, args.standby) if args.replace == Replace.RANK.value else 0,
        standby_mode=args.standby_mode,
        admit_waiting=args.admit_waiting,
        shm_name=job.shm_name,
        seats_at=store_endpoint(config.rdzv_backend, config.rdzv_endpoint),
        max_nodes=config.max_nodes,
    )
    agent.supervisor.native_stacks = args.native_stacks
    _forward_preemption(agent)
    return agent


def _exporter(args: argparse.Namespace, job: _Job, agent: ResilientAgent) -> Any:
    """This node's Prometheus endpoint (``--metrics-port``), started; None without one."""
    if args.metrics_port is None:
        return None
    from resilient.metrics.exporter import Exporter, RunMetrics

    os.environ[Var.METRICS_BY_AGENT] = "1"  # the workers leave the endpoint to us
    metrics = RunMetrics(
        job.events,
        run_id=job.run_id,
        heartbeat_dir=job.heartbeat_dir,
        global_ranks=lambda: {w.local_rank: w.global_rank for w in agent.workers()},
        labels={"slurm_job_id": job.slurm.job} if job.slurm is not None else None,
    )
    exporter = Exporter(metrics, args.metrics_port, args.metrics_addr)
    return exporter if exporter.start() else None


def _wind_up(
    args: argparse.Namespace,
    config: Any,
    spec: WorkerSpec,
    job: _Job,
    agent: ResilientAgent,
    events: EventLog,
    exporter: Any,
    result: RunResult | None,
) -> None:
    """The agent's run is over (or failed): what it leaves behind is flushed, closed, removed."""
    # The workers are done: a late preemption signal (a time limit's warning as the job ends)
    # has nothing left to stop, and one that came while the interpreter exits, its handlers
    # gone, would kill the launcher and replace its verdict with a signal's exit code.
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    agent.leave_seat(result)  # (first: a spare must not take the seat of a node that ends well)
    agent.close_standbys()
    agent.flush_before_exit(result, args.flush_timeout)  # (the job's shared memory goes next)
    agent.flusher.close()
    if exporter is not None:
        exporter.close(linger_s=max(0.0, args.metrics_linger))
    if agent.supervisor.excluded:
        agent.elastic.leave_rendezvous()  # the others go on without this node
    else:
        spec.rdzv_handler.shutdown()
    events.close()
    shutil.rmtree(job.heartbeat_dir, ignore_errors=True)  # heartbeats, standbys' ready marks
    ShmSnapshot(job.shm_name).unlink()  # the job is over: its snapshots go
    if not args.logs_specs and not args.log_dir and config.logs_specs is not None:
        shutil.rmtree(config.logs_specs.root_log_dir, ignore_errors=True)  # torch's temporary one


def _exit_code(
    args: argparse.Namespace, config: Any, job: _Job, agent: ResilientAgent, result: RunResult | None
) -> int:
    """The launcher's exit code, said on stderr where it is not 0 (and recorded as ``run_failed``
    where the launcher gives up)."""
    sup = agent.supervisor
    if result is None and sup.verdict is None:  # a spare node that parked until the job ended
        left = agent.seating.left if agent.seating is not None else None
        if left is not None:  # (not the job's success: the members' codes say what it was)
            print(f"resilient launch: this spare node leaves: {left}", file=sys.stderr)
            return int(ExitCode.HARD_FAULT)
        return int(ExitCode.SUCCESS)
    failed = result is not None and result.is_failed()
    if sup.verdict == int(ExitCode.FATAL) or (sup.verdict is None and not sup.excluded and failed):
        cause = sup.failures[-1]["cause"] if sup.failures else "restarts exhausted"
        with EventLog(job.events, rank=-1, **job.where) as log:
            log.emit(
                Event.RUN_FAILED,
                generation=0,
                step=None,
                error=f"resilient launch: {cause}",
                exitcode=sup.verdict,
            )
    if sup.verdict is not None:
        if sup.verdict == int(ExitCode.FATAL) and sup.failures:
            print(f"resilient launch: giving up: {sup.failures[-1]['cause']}", file=sys.stderr)
        return sup.verdict
    if sup.excluded:
        last = sup.health_failures[-1]["checks"][0] if sup.health_failures else {}
        n = agent.policy.history.health_failures
        print(
            f"resilient launch: this node left the job after {n} failed health "
            f"checks (last: {last.get('check')}: {last.get('detail')}); replace or repair it",
            file=sys.stderr,
        )
        return int(ExitCode.HARD_FAULT)
    if failed:
        summary = "; ".join(f"rank {f.get('global_rank')}: {f['cause']}" for f in sup.failures[-8:])
        within = f" within {args.restart_window:g} s" if args.restart_window else ""
        print(
            f"resilient launch: giving up after {config.max_restarts} group restarts{within}: {summary}",
            file=sys.stderr,
        )
        return int(ExitCode.FATAL)
    return int(ExitCode.SUCCESS)
