"""Sessions: `tests` (CI), `certify` (the main job: the recovery certificate), `soak`, `demo`, `lint`,
`slurm` (a real Slurm cluster on this machine)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True
# The sessions run on the Python that runs nox (3.10 or newer); this pin's CPU wheel is for 3.11,
# elsewhere pip takes PyPI's torch (a CUDA build, several GB).
PY = None
# A bare `torch` requirement pulls a multi-GB CUDA build; the CPU wheel of this version is what
# machines like ours (and CI) install first. Real users get the range from pyproject.
TORCH = "torch==2.13.0"


def _install(session: nox.Session, *extras: str) -> None:
    """torch (the pin above) first, then this project with the given extras (`dev`, `chaos`, `bench`)."""
    session.install(TORCH)
    session.install("-e", f".[{','.join(extras)}]")


# the trainers' integrations, torchdata and `engine: nvrx`: their CI tests run (each skips without its extra)
STACKS = ("lightning", "hf", "torchdata", "nvrx")


@nox.session(python=PY)
def tests(session: nox.Session) -> None:
    """Unit tests, then the multi-process gloo tests with real faults."""
    _install(session, "dev", "chaos", *STACKS)
    env = {"OMP_NUM_THREADS": "1"}
    # (the unit tests start no jobs: two workers, one per core)
    session.run("pytest", "tests/unit", "-q", "-p", "no:cacheprovider", "-n", "2", *session.posargs, env=env)
    session.run(
        "pytest",
        "tests/integration",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not slow and not slurm",  # (slurm: its own session, below)
        "--durations=12",  # (the suite's time budget: where it goes)
        *session.posargs,
        env=env,
    )


def _interpreter(version: str) -> str:
    """``python<version>`` where it runs, else the interpreter pyenv installed for it (this
    machine's pyenv puts shims on PATH that run only the versions it activated)."""
    exe = shutil.which(f"python{version}")
    if exe is not None and subprocess.run([exe, "--version"], capture_output=True).returncode == 0:
        return exe
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = sorted(glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}")))
    return found[-1] if found else f"python{version}"  # (nox then says it is missing)


@nox.session(name="tests-3.10", python=_interpreter("3.10"))
def tests_310(session: nox.Session) -> None:
    """The unit tests on the oldest Python pyproject declares (3.10). PyPI's only Linux torch is the
    CUDA build (~4.6 GB installed; the CPU wheel of the pin is for 3.11): a few minutes to install,
    so CI does not run it; run it before a release and after touching typing or stdlib APIs."""
    session.install(TORCH)
    session.install("-e", ".[dev,chaos]")
    session.run(
        "pytest", "tests/unit", "-q", "-p", "no:cacheprovider", *session.posargs, env={"OMP_NUM_THREADS": "1"}
    )


# The torch releases the project is tested on besides CI's pin: the oldest that passes (pyproject's
# floor) and the newest. A pip constraint capping torch below one of them must be lifted first.
# The floor, 2.13: 2.12.1 passes all but the pipeline example (its stage's static gradient metadata
# is refused: PipeliningMetadataError); 2.9-2.11 lack the elastic agent's shutdown timeout and the
# stage's input_grads; 2.6-2.8 DCP's Metadata.version (the sharded codec).
TORCH_MATRIX = {"floor": "2.13.0", "2.14": "2.14.1", "2.15": "2.15.0"}
MATRIX_CLASSES = "exception,hang,oom,nan,sigkill_warm"


def _matrix(session: nox.Session, version: str) -> None:
    """On ``torch==version``: the unit tests, the CI integration tests, and the CPU certificate of
    the in-process classes and a killed rank's warm replacement, once each; the time printed."""
    t0 = time.monotonic()
    pin = f"torch=={version}"  # (in every install, so that no extra moves torch)
    session.install(pin)
    session.install("-e", f".[{','.join(('dev', 'chaos', *STACKS))}]", pin)
    session.run("python", "-c", "import torch; print('torch', torch.__version__)")
    env = {"OMP_NUM_THREADS": "1"}
    session.run("pytest", "tests/unit", "-q", "-p", "no:cacheprovider", "-n", "2", env=env)
    session.run(
        "pytest", "tests/integration", "-q", "-p", "no:cacheprovider", "-m", "not slow and not slurm", env=env
    )
    out = f"chaos_torch_{version}"
    session.run(
        "chaos",
        "certify",
        "configs/chaos/cpu.yaml",
        "--classes",
        MATRIX_CLASSES,
        "--trials",
        "1",
        "--out",
        out,
        env=env,
    )
    session.log(f"torch {version}: the matrix session took {time.monotonic() - t0:.0f} s")


@nox.session(name="tests-torch-floor", python=PY)
def tests_torch_floor(session: nox.Session) -> None:
    """The matrix (see ``_matrix``) on the oldest torch pyproject admits."""
    _matrix(session, TORCH_MATRIX["floor"])


@nox.session(name="tests-torch-2.14", python=PY)
def tests_torch_214(session: nox.Session) -> None:
    """The matrix on torch 2.14."""
    _matrix(session, TORCH_MATRIX["2.14"])


@nox.session(name="tests-torch-2.15", python=PY)
def tests_torch_215(session: nox.Session) -> None:
    """The matrix on torch 2.15 (a download of a few GB)."""
    _matrix(session, TORCH_MATRIX["2.15"])


@nox.session(python=PY)
def slow(session: nox.Session) -> None:
    """The integration tests too long for CI: a torch.compile'd model re-entered after a fault, the
    whole-group variants of SIGSTOP and of a repeating hard fault, a replacement with no standby,
    SIGSTOP replaced, 2-D meshes at 4 ranks, a transformers script's parked standby, a node
    excluded by its health checks, `chaos run`'s schedule, two nodes' whole-group restart; and the
    variants CI leaves out to keep within its budget (each marked with the CI test that covers its
    path): SIGKILL, a kernel OOM-kill and a GIL hang relaunched whole, flush on death, 3-rank
    replacements, the parked standby's prepare... About 35 minutes."""
    _install(session, "dev", "chaos", *STACKS)
    args = ["tests/integration", "-q", "-p", "no:cacheprovider", "-m", "slow", *session.posargs]
    session.run("pytest", *args, env={"OMP_NUM_THREADS": "1"})


@nox.session(python=PY)
def slurm(session: nox.Session) -> None:
    """examples/slurm.sbatch under a real Slurm: slurmctld, slurmdbd (MariaDB) and three slurmd on
    this machine (tests/integration/slurm_cluster.py installs Debian's slurm-wlm, munge and MariaDB
    where they are missing, as root; without root the tests skip, saying why), every fault case at
    2x1 and 2x2 ranks; each case's run time is printed (`[slurm] ...`). Not in CI (tens of minutes
    on 2 cores); CI runs the script's requeue rules against stand-ins (test_slurm_script.py)."""
    _install(session, "dev", "chaos")
    files = ["tests/integration/test_slurm_script.py", "tests/integration/test_slurm.py"]
    args = [*files, "-q", "-p", "no:cacheprovider", "-rsP", "--durations=0"]
    session.run("pytest", *args, *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session(python=PY)
def fuzz(session: nox.Session) -> None:
    """tests/unit/test_trust.py with FUZZ_EXAMPLES cases per property (default 2500; CI runs 150):
    mutated manifests, bytes of manifests and shards, plan flags, config values."""
    _install(session, "dev", "chaos")
    n = os.environ.get("FUZZ_EXAMPLES", "2500")
    args = ["tests/unit/test_trust.py", "-q", "-p", "no:cacheprovider", "--hypothesis-show-statistics"]
    session.run("pytest", *args, *session.posargs, env={"OMP_NUM_THREADS": "1", "FUZZ_EXAMPLES": n})


@nox.session(python=PY)
def demo(session: nox.Session) -> None:
    """The bundled example under injected faults, checked against a fault-free run."""
    _install(session, "dev")
    session.run("python", "examples/demo.py", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session(python=PY)
def lint(session: nox.Session) -> None:
    _install(session, "dev", "chaos", "bench")
    session.run("ruff", "check", ".")
    session.run("mypy")


@nox.session(python=PY)
def bench(session: nox.Session) -> None:
    """Peers side by side in one run (benchmarks/suite.py): a fault's cost (exception, hang,
    SIGKILL) under resilient, torchrun + dcp.async_save, NVRx ft_launcher, NVRx's in-process
    Wrapper and torchft + Lighthouse, 5 trials; goodput under a seeded schedule; the whole
    runtime's fault-free overhead; checkpoint blocking 64 MB-4 GB; the planner at 1k-16k GPUs.
    suite.json (stamped), suite.png, the table. On a quiet machine: about an hour."""
    _install(session, "dev", "bench")
    # torchft's own pins would replace torch: its wheel alone, and the small packages it imports
    session.install("--no-deps", "torchft==0.2.0")
    session.install("opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")
    session.run("python", "benchmarks/suite.py", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session(name="bench-recovery", python=PY)
def bench_recovery(session: nox.Session) -> None:
    """An exception's in-process recovery at 2, 4 and 8 ranks, NVRx's in-process Wrapper after
    ours at each, in one run, with our recovery's phases per rank count and the phase that grows
    most named (benchmarks/recovery.py; its fault-free overhead part with --overhead-runs).
    About 10 min."""
    _install(session, "dev", "bench")
    args = session.posargs or ["--trials", "5", "--skip-overhead"]
    session.run("python", "benchmarks/recovery.py", *args, env={"OMP_NUM_THREADS": "1"})


@nox.session(name="bench-replace", python=PY)
def bench_replace(session: nox.Session) -> None:
    """A dead rank replaced alone vs the whole group relaunched vs torchrun, NVRx ft_launcher and
    torchft 0.2.0, side by side (benchmarks/replace.py: the example, SIGKILL and SIGSTOP; then
    examples/train_hf.py, parked vs importing standby, and its model built by prepare= or not);
    then the ~1 GB state (benchmarks/relaunch.py), then a lost node (benchmarks/lost_node.py).
    About an hour."""
    _install(session, "dev", "bench")
    # torchft's own pins would replace torch: its wheel alone, and the small packages it imports
    session.install("--no-deps", "torchft==0.2.0")
    session.install("opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")
    env = {"OMP_NUM_THREADS": "1"}
    session.run("python", "benchmarks/replace.py", "--trials", "8", *session.posargs, env=env)
    # a script whose imports take seconds (transformers): a parked standby against an importing one
    session.run("python", "benchmarks/replace.py", "--script", "hf", "--trials", "5", "--at", "150",
                "--steps", "200", "--out", "benchmarks/results/replace_hf.json", env=env)  # fmt: skip
    # the same script with a bigger model, built in prepare= (by the parked standby) or after promotion
    session.run("python", "benchmarks/replace.py", "--script", "hf", "--modes", "rank,rank-prepare",
                "--trials", "5", "--at", "100", "--steps", "150", "--script-args=--layers 6 --width 384",
                "--out", "benchmarks/results/replace_prepare.json", env=env)  # fmt: skip
    session.run("python", "benchmarks/relaunch.py", "--trials", "5", env=env)
    # a lost node with a spare: its rank's state from a survivor's memory vs from the checkpoint
    session.run("python", "benchmarks/lost_node.py", "--trials", "5", env=env)


@nox.session(name="bench-work-lost", python=PY)
def bench_work_lost(session: nox.Session) -> None:
    """Seconds of training lost per fault (exception, hang, SIGKILL at 2 and 4 ranks) under
    resilient launch, torchrun + torch.save, NVRx's in-process Wrapper and torchft 0.2.0, side by
    side (benchmarks/work_lost_peers.py: table, work_lost_peers.json). About an hour with the
    default 3 trials."""
    _install(session, "dev", "bench")
    # torchft's own pins would replace torch: its wheel alone, and the small packages it imports
    session.install("--no-deps", "torchft==0.2.0")
    session.install("opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")
    env = {"OMP_NUM_THREADS": "1"}
    session.run("python", "benchmarks/work_lost_peers.py", *session.posargs, env=env)


@nox.session(python=PY)
def certify(session: nox.Session) -> None:
    """The CPU recovery certificate (5 trials per fault class: table, certificate.json,
    timeline.png), then goodput under a fault every 60 s (stream.json). Exit 1 on a failed SLO."""
    _install(session, "dev", "chaos")
    env = {"OMP_NUM_THREADS": "1"}
    args = session.posargs or ["configs/chaos/cpu.yaml", "--out", "chaos_out", "--trials", "5"]
    session.run("chaos", "certify", *args, env=env)
    if not session.posargs:
        session.run("chaos", "stream", "configs/chaos/cpu.yaml", "--out", "chaos_out/stream", env=env)


@nox.session(name="certify-stacks", python=PY)
def certify_stacks(session: nox.Session) -> None:
    """The user-style examples' certificates: the FSDP2 transformer (1-D, FSDP + TP and HSDP on
    2-D meshes at 4 ranks), the DataLoader epoch loop, the accumulation loop and the pipeline
    (2 stages, alone and x 2 DDP replicas), every class they list, 3 trials each (chaos_fsdp2/,
    chaos_mesh2d/, chaos_hsdp/, chaos_epochs/, chaos_accum/, chaos_pipeline/). Exit 1 on a failed
    SLO."""
    _install(session, "dev", "chaos")
    env = {"OMP_NUM_THREADS": "1"}
    trials = session.posargs or ["--trials", "3"]
    jobs = ("fsdp2", "fsdp2"), ("mesh2d", "mesh2d"), ("hsdp", "hsdp"), ("ddp_epochs", "epochs")
    jobs += ("accum", "accum"), ("pipeline", "pipeline")
    for cfg, out in jobs:
        out = f"chaos_{out}"
        session.run("chaos", "certify", f"configs/chaos/{cfg}.yaml", "--out", out, *trials, env=env)


@nox.session(name="certify-nodes", python=PY)
def certify_nodes(session: nox.Session) -> None:
    """A lost node (configs/chaos/nodes.yaml): two nodes of one rank and a parked spare node; the
    node holding rank 1 loses every process and its /dev/shm. DDP: the spare takes its seat, the
    survivor keeps its process; FSDP2: the group restarts from the checkpoint. Bit-exact
    (chaos_nodes/). About 3 min a trial."""
    _install(session, "dev", "chaos")
    trials = session.posargs or ["--trials", "1"]
    env = {"OMP_NUM_THREADS": "1"}
    session.run("chaos", "certify", "configs/chaos/nodes.yaml", "--out", "chaos_nodes", *trials, env=env)


@nox.session(name="certify-compound", python=PY)
def certify_compound(session: nox.Session) -> None:
    """Faults inside a recovery (configs/chaos/compound.yaml): an exception in the restore, the
    same fault again in the first step, a SIGKILL of the other rank in agree or of the faulted
    rank in leave, a hang in the group's rebuild, a GIL-bound hang in the health checks, a
    promoted standby SIGKILLed as it joins, a second rank's SIGKILL while the first is replaced,
    the rank that commits SIGKILLed mid-commit; 3 trials each, bit-exact (chaos_compound/).
    About 14 min. (The store's node lost: configs/chaos/nodes.yaml, nox -s certify-nodes.)"""
    _install(session, "dev", "chaos")
    trials = session.posargs or ["--trials", "3"]
    env = {"OMP_NUM_THREADS": "1"}
    session.run(
        "chaos", "certify", "configs/chaos/compound.yaml", "--out", "chaos_compound", *trials, env=env
    )


@nox.session(name="certify-live", python=PY)
def certify_live(session: nox.Session) -> None:
    """Live resume across the stacks (configs/chaos/live.yaml): exception, OOM, hang and a stalled
    collective on DDP at 2 and 3 ranks, FSDP2 (with TP too), a transformers GPT-2 and Lightning,
    and a SIGKILL with a standby parked, each held to 0 steps lost and bit-exact (chaos_live/);
    then every stack's replay from the ring held to replay_verified (configs/chaos/replay.yaml,
    chaos_replay/). About 30 min."""
    _install(session, "dev", "chaos", *STACKS)
    trials = session.posargs or ["--trials", "1"]
    env = {"OMP_NUM_THREADS": "1"}
    session.run("chaos", "certify", "configs/chaos/live.yaml", "--out", "chaos_live", *trials, env=env)
    session.run("chaos", "certify", "configs/chaos/replay.yaml", "--out", "chaos_replay", *trials, env=env)


@nox.session(python=PY)
def soak(session: nox.Session) -> None:
    """1,000 faults, soft, hard, silent and compound, over the training stacks of examples/, 20 to
    a job, each job bit-exact (configs/chaos/soak.yaml, chaos/soak.py; hours on 2 cores);
    `nox -s soak -- --faults 100` for a quick look. soak.json and soak.png in chaos_soak/."""
    _install(session, "dev", "chaos", *STACKS)
    args = ["configs/chaos/soak.yaml", "--out", "chaos_soak", *session.posargs]
    session.run("chaos", "soak", *args, env={"OMP_NUM_THREADS": "1"})


@nox.session(python=PY)
def gpu(session: nox.Session) -> None:
    """The NCCL/CUDA tests, on a machine with a GPU (a CUDA build of torch: no CPU pin here)."""
    session.install("-e", ".[dev]")
    session.run("pytest", "tests/gpu", "-m", "gpu", "-q", "-rs", *session.posargs)
