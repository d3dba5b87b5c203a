"""Declarative chaos schedules (``configs/chaos/*.yaml``), validated, deterministic under a seed.

A certificate config names the job (the bundled example by default), and per fault class: the
fault (kind, target rank, the step it fires at), how many trials, and the SLOs it must meet::

    seed: 0
    job: {nproc: 2, steps: 40, step_ms: 50, hang_timeout: 2, heartbeat_timeout: 3}
    classes:
      exception: {fault: exception, step: 12, rank: 1, slo: {recover_s: 1.0}}
      sigkill:   {fault: sigkill, step: 12, rank: 1, slo: {recover_s: 5.0}}

A trial's fault step is drawn from ``step`` ± ``jitter`` with the seed (trial ``t`` of class
``c`` uses ``Random(f"{seed}/{c}/{t}")``), so a certificate is reproducible run to run.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from chaos.faults import REGISTRY
from resilient.config import yaml_problem
from resilient.metrics.phases import PHASES
from resilient.runtime.hooks import POINTS

# the fault kinds' names (chaos/faults): pydantic checks a config's `fault:` against them and names
# them all when one is unknown
if TYPE_CHECKING:
    KindName = str
    PhaseName = str
    PointName = str
    PointKind = str
else:
    KindName = Literal[REGISTRY.names()]
    PhaseName = Literal[PHASES]  # (a budget for a phase that is not one is refused, by name)
    PointName = Literal[POINTS]
    PointKind = Literal[REGISTRY.names(lambda k: k.in_recovery)]


class BadInput(Exception):
    """A command line or config the chaos tools refuse (exit 2, the message names the culprit)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SLO(_Model):
    detect_s: float | None = Field(None, gt=0, description="fault → first detection event, at most")
    recover_s: float | None = Field(None, gt=0, description="fault → first step completed after, at most")
    steps_lost_max: int | None = Field(None, ge=0)
    names_rank: bool = Field(
        False, description="bitflip at 3+ ranks: the replicas' majority names the faulty rank (sdc_detected)"
    )
    detect_at_step: bool = Field(
        False, description="the detection names the fault's own step (nan, grad_spike: before it is applied)"
    )
    goodput_min: float | None = Field(None, gt=0, le=1)
    bit_exact: bool = True
    previous_checkpoint_loads: bool = False  # corrupt_checkpoint: the one before the newest loads
    restarts_max: int | None = Field(
        None, ge=0, description="restarts (in-process or relaunch) at most; slow_disk: 0, it is no crash"
    )
    checkpoints_load: bool = Field(True, description="every checkpoint left committed loads on every rank")
    recover_after_restore_s: float | None = Field(
        None, gt=0, description="link faults: link back → first step completed after, at most"
    )
    detect_rank: bool = Field(False, description="the detection event names the faulty rank (straggler)")
    replay_verified: bool = Field(
        False,
        description="a restore from a snapshot: the runtime compared the replay with the run it "
        "replays and found it equal (replay_verified, docs/recovery.md#replay-verification)",
    )
    standby_ready: bool = Field(
        False, description="a standby waited when the harness fired (parked or imported): a warm replacement"
    )
    ends_with: int | None = Field(
        None,
        description="a documented end instead of a finish: the launcher exits with this code (the "
        "job cannot go on: 74, its store's host lost), its reason in run_failed, its checkpoints loading",
    )
    ends_within_s: float | None = Field(
        None, gt=0, description="ends_with: fault → the launcher's exit, at most"
    )
    rate_back_s: float | None = Field(
        None, gt=0, description="detection → steps within 10 % of the fault-free step time again, at most"
    )
    recover_p50_s: float | None = Field(
        None, gt=0, description="the median of the trials' recover_s, at most (recover_s holds each trial)"
    )
    phase_p50_s: dict[PhaseName, float] = Field(
        default_factory=dict,
        description="in-process recoveries: each named phase's median wall time over the trials, at most "
        "(resilient/metrics/phases.py: detect, leave, health, agree, free, rebuild, restore, reenter, rerun)",
    )
    phase_cpu_p50_s: dict[PhaseName, float] = Field(
        default_factory=dict,
        description="in-process recoveries: each named phase's median CPU time over the trials (the main "
        "thread's, on the rank where it cost most), at most: what the runtime's own work costs, "
        "whatever else the machine runs",
    )


Point = Literal["step", "forward", "backward"]


class During(_Model):
    """A compound class's second fault: fired by ``rank`` itself when its recovery from the first
    reaches ``phase`` (chaos/inject.py ``kind@point:rank``)."""

    phase: PointName = Field(..., description="where in the recovery (resilient/runtime/hooks.py POINTS)")
    fault: PointKind = Field(
        ..., description="what fires there: exception, hang, gil_hang, segfault, sigkill"
    )
    rank: int = Field(1, ge=0)

    def spec(self) -> str:
        return f"{self.fault}@{self.phase}:{self.rank}"


class FaultClass(_Model):
    fault: KindName
    step: int = Field(
        ..., ge=1, description="the step the fault fires at (first attempt); '30%': that share of job.steps"
    )
    rank: int = Field(1, ge=0)
    at: Point = Field(
        "step",
        description="in-process faults: at the step's start, or inside it at a microbatch's "
        "forward or backward in the stage's module (a pipeline's: chaos/points.py)",
    )
    microbatch: int = Field(0, ge=0, description="`at: forward|backward`: the microbatch (from 0)")
    during: During | None = Field(
        None, description="a second fault, inside the recovery from the first (a compound class)"
    )
    jitter: int = Field(0, ge=0, description="trials draw the step from step ± jitter")
    arg: float | None = None  # the kind's `=arg` (`chaos kinds`: stall s, kernel_oom MiB, ...)
    duration: float = Field(10.0, gt=0, description="link faults, slow_disk: seconds the fault lasts")
    trials: int | None = Field(None, ge=1)
    slo: SLO = Field(default_factory=SLO, description="without one: the kind's default SLO, if it has one")
    job: dict[str, Any] = Field(
        default_factory=dict,
        description="job fields for this class's trials (its own fault-free reference); runtime merges",
    )

    @model_validator(mode="before")
    @classmethod
    def _kind_slo(cls, data: Any) -> Any:
        name = data.get("fault") if isinstance(data, dict) else None
        kind = REGISTRY.get(name) if isinstance(name, str) else None
        if kind is not None and "slo" not in data and kind.default_slo is not None:
            return {**data, "slo": dict(kind.default_slo)}
        return data


class Job(_Model):
    command: list[str] | None = Field(
        None,
        description="the training script and its arguments, run under `resilient launch` in the "
        "trial's directory; None: the bundled example (examples/train_tiny.py) with the fields below",
    )
    workdir: str | None = Field(
        None,
        description="where the command runs (its relative paths: a config file, a data directory); "
        "None: the trial's own directory. `chaos certify ... -- train.py` runs it where chaos was "
        "run; the trial's events, injections and final states stay in the trial's directory",
    )
    checkpoint_dir: str = Field(
        "ck", description="where the command checkpoints, relative to the directory it runs in"
    )
    nproc: int = Field(2, ge=1, le=8)
    nodes: int = Field(
        1,
        ge=1,
        le=4,
        description="`resilient launch` agents the ranks are spread over (a c10d rendezvous on "
        "127.0.0.1, nproc / nodes ranks each), as nodes of one job",
    )
    spare: bool = Field(
        False,
        description="one more agent, started once the nodes' workers run: it parks as their spare "
        "node (docs/launcher.md#several-nodes)",
    )
    backend: Literal["gloo", "nccl", "auto"] = "gloo"  # the bundled example's; nccl: one GPU per rank
    steps: int = Field(40, ge=4)
    step_ms: float = Field(50.0, ge=0)
    pad_at: Literal["tail", "forward"] = Field(
        "tail",
        description="where the bundled example spends step_ms: after its optimizer step, or "
        "before its backward (where a real step spends its time)",
    )
    hang_timeout: float = Field(2.0, gt=0)
    heartbeat_timeout: float = Field(3.0, gt=0)
    checkpoint_every: int = Field(5, ge=1)
    max_restarts: int = Field(3, ge=0, description="the launcher's --max-restarts (whole-group restarts)")
    max_replacements: int = Field(
        10, ge=0, description="the launcher's --max-replacements (ranks replaced alone)"
    )
    runtime: dict[str, object] = Field(
        default_factory=dict,
        description="runtime config for the bundled example (its --config), e.g. "
        "{restart: {max_recoveries: 500}}",
    )
    timeout_s: float = Field(180.0, gt=0, description="a trial running longer is killed and fails")

    @model_validator(mode="after")
    def _spread(self) -> Job:
        if self.nproc % self.nodes:
            raise ValueError(f"nproc {self.nproc} is not a multiple of nodes {self.nodes}")
        if self.spare and self.nodes < 2:
            raise ValueError("spare: a spare node stands beside nodes: 2 or more")
        return self


_STREAM_KINDS: tuple[KindName, ...] = ("exception", "hang", "oom", "sigkill")
# every kind a long job can take (cuda_oom: on a GPU); link faults hit the rank behind the veth
STREAM_KINDS = REGISTRY.names(lambda k: k.streams)


class Planned(_Model):
    """One fault of an explicit schedule (``schedule:``, run by ``chaos run``)."""

    fault: KindName
    rank: int = Field(1, ge=0, description="link faults: the rank behind the veth link (one per run)")
    step: int | None = Field(None, ge=1, description="fire when the rank starts this step...")
    at_s: float | None = Field(None, ge=0, description="...or after this much fault-free training time")
    arg: float | None = None  # as FaultClass.arg
    duration: float = Field(3.0, gt=0, description="link faults, slow_disk: seconds the fault lasts")
    repeat: int = Field(1, ge=1, description="in-process faults: fire again each time the step re-runs")
    at: Point = "step"  # as FaultClass.at
    microbatch: int = Field(0, ge=0)
    during: During | None = Field(
        None, description="a second fault, at the first recovery of its rank that reaches its point"
    )

    @model_validator(mode="after")
    def _when(self) -> Planned:
        if (self.step is None) == (self.at_s is None):
            raise ValueError("give exactly one of step / at_s")
        if self.repeat > 1 and not REGISTRY[self.fault].in_process:
            raise ValueError(f"repeat: only in-process faults re-fire, not {self.fault}")
        if self.at != "step" and not REGISTRY[self.fault].in_process:
            raise ValueError(f"at: {self.at}: only in-process faults fire inside a step, not {self.fault}")
        return self

    def spec(self, step: int) -> str:
        """The in-process plan entry (chaos/inject.py) for this fault at ``step``."""
        arg = self.arg if self.arg is not None else REGISTRY[self.fault].default_arg
        return (
            f"{self.fault}@{step}:{self.rank}"
            + (f"={arg:g}" if arg is not None else "")
            + (f"x{self.repeat}" if self.repeat > 1 else "")
            + (f"/{self.at}{self.microbatch}" if self.at != "step" else "")
        )


class Stream(_Model):
    """Many faults in one long job: a fault every ``mtbf_s`` seconds (``random``: exponential
    inter-arrival times with that mean), kind and rank drawn with the seed. ``nox -s certify``
    runs it for goodput; ``nox -s soak`` with at least 200 faults of every kind."""

    mtbf_s: float = Field(60.0, gt=0)
    faults: int = Field(4, ge=1, description="how many faults the run gets (its length follows)")
    random: bool = False
    kinds: list[KindName] = Field(default_factory=lambda: list(_STREAM_KINDS))
    args: dict[str, float] = Field(default_factory=dict, description="per kind, as FaultClass.arg")
    duration_s: float = Field(3.0, gt=0, description="link_drop and slow_disk last this long")
    checkpoint_every: int = Field(100, ge=1)
    job: dict[str, Any] = Field(default_factory=dict, description="job fields for the stream's run")
    slo: SLO = Field(default_factory=lambda: SLO(goodput_min=0.9))

    @model_validator(mode="after")
    def _kinds_streamable(self) -> Stream:
        bad = [k for k in self.kinds if k not in STREAM_KINDS]
        if bad:
            raise ValueError(f"kinds: {bad} cannot run in a stream (it runs {list(STREAM_KINDS)})")
        return self


class Certification(_Model):
    seed: int = 0
    trials: int = Field(1, ge=1)
    job: Job = Field(default_factory=Job)
    classes: dict[str, FaultClass] = Field(default_factory=dict)
    stream: Stream | None = None
    schedule: list[Planned] = Field(default_factory=list, description="`chaos run`: these faults, in one job")

    @model_validator(mode="before")
    @classmethod
    def _share_of_the_job(cls, raw: Any) -> Any:
        """A class's ``step: "30%"`` is that share of its job's steps (``chaos certify --steps``
        fits a config to a script's length), at least step 1."""
        if not isinstance(raw, dict) or not isinstance(raw.get("classes"), dict):
            return raw
        steps = (raw.get("job") or {}).get("steps", Job.model_fields["steps"].default)
        classes = {}
        for name, c in raw["classes"].items():
            if isinstance(c, dict) and isinstance(c.get("step"), str) and c["step"].endswith("%"):
                total = (c.get("job") or {}).get("steps", steps)
                try:
                    share = float(c["step"][:-1]) / 100
                except ValueError:
                    why = f"classes.{name}.step: {c['step']!r} is not a share like '30%'"
                    raise ValueError(why) from None
                c = {**c, "step": max(1, round(share * total))}
            classes[name] = c
        return {**raw, "classes": classes}

    @model_validator(mode="after")
    def _ranks_exist(self) -> Certification:
        for name, c in self.classes.items():
            why = REGISTRY[c.fault].check_arg(c.arg)
            if why is not None:
                raise ValueError(f"classes.{name}.arg: {why}")
            nproc, steps = c.job.get("nproc", self.job.nproc), c.job.get("steps", self.job.steps)
            if c.rank >= nproc:
                raise ValueError(f"classes.{name}.rank: {c.rank} but job.nproc is {nproc}")
            if c.during is not None and c.during.rank >= nproc:
                raise ValueError(f"classes.{name}.during.rank: {c.during.rank} but job.nproc is {nproc}")
            if c.step + c.jitter >= steps - 1:
                raise ValueError(
                    f"classes.{name}.step: {c.step} (+ jitter {c.jitter}) leaves no step after it "
                    f"(job.steps is {steps})"
                )
        for i, f in enumerate(self.schedule):
            if f.rank >= self.job.nproc:
                raise ValueError(f"schedule.{i}.rank: {f.rank} but job.nproc is {self.job.nproc}")
            if f.step is not None and f.step >= self.job.steps - 1:
                raise ValueError(
                    f"schedule.{i}.step: {f.step} leaves no step after it (job.steps is {self.job.steps})"
                )
        links = {f.rank for f in self.schedule if REGISTRY[f.fault].on_link}
        if len(links) > 1:
            raise ValueError(
                f"schedule: link faults on ranks {sorted(links)}; one rank per run sits behind the veth"
            )
        return self

    def for_class(self, name: str) -> Certification:
        """This certificate with the job of class ``name`` (its ``job:`` fields over the job's)."""
        over = self.classes[name].job
        if not over:
            return self
        runtime = {**self.job.runtime, **over.get("runtime", {})}
        job = Job.model_validate({**self.job.model_dump(), **over, "runtime": runtime})
        return self.model_copy(update={"job": job})

    def trial_step(self, name: str, trial: int) -> int:
        c = self.classes[name]
        return c.step + random.Random(f"{self.seed}/{name}/{trial}").randint(-c.jitter, c.jitter)

    def trials_of(self, name: str) -> int:
        return self.classes[name].trials or self.trials


def load(path: Path | str, steps: int | None = None) -> Certification:
    """The certificate config at ``path`` (``steps``: the job's length, over the file's); errors
    name the file and the bad field."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as e:
        raise BadInput(f"{p}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise BadInput(f"{p}: not valid YAML: {yaml_problem(e)}") from None
    raw = raw or {}
    if steps is not None and isinstance(raw, dict):
        raw = {**raw, "job": {**(raw.get("job") or {}), "steps": steps}}
    try:
        return Certification.model_validate(raw)
    except ValidationError as e:
        lines = [f"{p}: invalid chaos config"]
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            lines.append(f"  {loc}: {err['msg']}")
        raise BadInput("\n".join(lines)) from None
