"""examples/slurm.sbatch's decisions, without a cluster: `srun`, `scontrol` and `resilient` are
stand-ins on PATH that give each node's launcher the exit code a case names, and record what the
script asked of Slurm. The script itself runs unchanged (the real cluster: test_slurm.py).

Not marked `slurm`: it needs bash alone and takes about a second, so CI keeps the requeue rules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm.sbatch"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# srun: each node's task (from `bash -c` on) runs with its SLURMD_NODENAME; srun's own exit code
# is the highest of the tasks', as the real one's is; signals it gets are taken (the real one
# passes them on to the tasks)
SRUN = f"""#!{sys.executable}
import os, signal, subprocess, sys
for s in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(s, lambda *_: None)
argv = sys.argv[1:]
task = argv[argv.index("bash"):]
env = {{**os.environ, "BATCH_PID": str(os.getppid())}}
nodes = os.environ["FAKE_NODES"].split()
procs = [subprocess.Popen(task, env={{**env, "SLURMD_NODENAME": n}}) for n in nodes]
codes = [p.wait() for p in procs]
if os.environ.get("FAKE_UNSHARED"):  # (the tasks wrote their codes where the batch script cannot see)
    import shutil
    shutil.rmtree(task[3])
sys.exit(max(c if c >= 0 else 128 - c for c in codes))
"""
# resilient: exits with FAKE_RC_<node>; `lost` kills its task's shell first (no code is written);
# FAKE_SIGNAL: n1's sends that signal to the batch script before it exits (Slurm's, or yours)
RESILIENT = """#!/bin/bash
echo "$*" > "$FAKE_CALLS.launch.$SLURMD_NODENAME"
var=FAKE_RC_$SLURMD_NODENAME
if [[ -n ${FAKE_SIGNAL:-} && $SLURMD_NODENAME == n1 ]]; then
    kill -"$FAKE_SIGNAL" "$BATCH_PID"; sleep 0.3
fi
if [[ ${!var} == lost ]]; then kill -KILL "$PPID"; exit 137; fi
exit "${!var}"
"""
SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") printf '%s\\n' $FAKE_NODES ;;
    "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=10.0.0.$3 NodeHostName=$3" ;;
    *) echo "$*" >> "$FAKE_CALLS" ;;
esac
"""


def run_script(
    tmp_path: Path, n1: str, n2: str, signal: str = "", restarts: int = 0, unshared: bool = False
) -> tuple[int, str, list[str]]:
    """The script's exit code, its output and what it asked of scontrol besides `show`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("resilient", RESILIENT), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_CPUS_ON_NODE": "2",
        "FAKE_NODES": "n1 n2", "FAKE_CALLS": str(calls), "FAKE_RC_n1": n1, "FAKE_RC_n2": n2,
        "FAKE_SIGNAL": signal, **({"SLURM_RESTART_COUNT": str(restarts)} if restarts else {}),
        **({"FAKE_UNSHARED": "1"} if unshared else {}),
    }  # fmt: skip
    r = subprocess.run(["bash", str(SBATCH), "--nproc-per-node", "2", "train.py", "--steps", "9"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)  # fmt: skip
    asked = calls.read_text().splitlines() if calls.exists() else []
    return r.returncode, r.stdout + r.stderr, asked


@pytest.mark.parametrize(
    ("n1", "n2", "signal", "rc", "requeued", "says"),
    [
        ("0", "0", "", 0, False, "training finished"),
        ("76", "76", "", 76, True, "preempted: final checkpoint committed; requeueing"),
        # the time limit's warning (--signal=B:USR1@...), or scancel --batch --signal=USR1
        ("76", "76", "USR1", 76, True, "requeueing"),
        # scontrol requeue, a preemption, scancel: Slurm requeues (or ends) the job itself
        ("76", "76", "TERM", 76, False, "Slurm requeues the job"),
        # a node that left the job while the other finished: training is done, the node is named
        ("0", "75", "", 0, False, "node n2 left the job (exit 75: failed health checks)"),
        ("3", "75", "", 3, False, "gave up"),
        ("76", "3", "", 3, False, "gave up"),
        ("75", "75", "", 75, True, "no node finished (failed health checks: n"),
        ("0", "lost", "", 0, False, "node n2 left no exit code"),
        # srun ended before Slurm noticed a lost node (no TERM yet): run again without it
        ("75", "lost", "", 75, True, "no node finished (failed health checks: n1; lost: n2); requeueing"),
        ("1", "lost", "", 137, False, "without a launcher's verdict"),
        ("lost", "lost", "", 137, False, "without a launcher's verdict"),
        ("lost", "lost", "TERM", 137, False, "Slurm ended the job"),
    ],
)
def test_the_script_requeues_exactly_when_the_launchers_exit_codes_say_so(
    tmp_path: Path, n1: str, n2: str, signal: str, rc: int, requeued: bool, says: str
) -> None:
    code, out, asked = run_script(tmp_path, n1, n2, signal)
    assert code == rc, out
    assert ("requeue 4242" in asked) == requeued, (asked, out)
    assert says in out, out
    assert not (tmp_path / ".resilient-exit" / "4242.0").exists()  # (the codes are cleaned up)
    if (n1, n2) in (("75", "75"), ("75", "lost")):
        assert asked[-1].split()[-1] in ("ExcNodeList=n1,n2", "ExcNodeList=n2,n1"), asked


def test_each_node_runs_one_launcher_with_the_rendezvous_on_the_first_node(tmp_path: Path) -> None:
    code, out, _ = run_script(tmp_path, "0", "0")
    assert code == 0, out
    port = 20000 + 4242 % 20000
    rest = f"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 10.0.0.n1:{port} --rdzv-id slurm-4242"
    for node, host in (("n1", 1), ("n2", 0)):  # the first node's launcher hosts the rendezvous' store
        want = f"launch --rdzv-conf is_host={host} {rest} --nproc-per-node 2 train.py --steps 9"
        assert (tmp_path / f"calls.launch.{node}").read_text().strip() == want
    text = SBATCH.read_text()
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@", "#SBATCH --ntasks-per-node=1"):
        assert line in text


def test_the_requeues_of_one_job_are_bounded(tmp_path: Path) -> None:
    code, out, asked = run_script(tmp_path, "76", "76", restarts=20)
    assert (code, asked) == (76, []), out
    assert "not requeued: this job ran 21 times (MAX_REQUEUES=20)" in out
    assert os.path.exists(SBATCH)


@pytest.mark.parametrize(
    ("n1", "n2", "rc", "requeued"), [("76", "76", 76, True), ("3", "0", 3, False), ("75", "75", 75, True)]
)
def test_without_a_shared_submit_directory_srun_s_highest_code_decides(
    tmp_path: Path, n1: str, n2: str, rc: int, requeued: bool
) -> None:
    code, out, asked = run_script(tmp_path, n1, n2, unshared=True)
    assert code == rc and ("requeue 4242" in asked) == requeued, out
    assert f"launchers' exit codes: srun={rc} (srun: {rc})" in out
    assert not any(a.startswith("update") for a in asked)  # (no node is named: none is excluded)
