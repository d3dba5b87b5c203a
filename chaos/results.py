"""What made a result: every file under ``benchmarks/results/`` carries a stamp.

    st = results.begin(trials=5)           # before the run: commit, tree, command, versions, machine, load
    ...
    results.write(path, report, st)        # after it: the load after, the wall time; the file written

A result made on a tree with changes says so (``tree_clean: false``); a run whose load average was
above the core count says ``loaded: true``. A partial run (``complete=False``) never replaces a
complete result: it is written beside it (``<name>.partial.json``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from resilient.runtime import RECOVERY_PATH

ROOT = Path(__file__).resolve().parents[1]  # (the repository, for an editable install)
PEERS = ("nvidia-resiliency-ext", "torchft", "lightning", "transformers", "accelerate", "torchdata")


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _word(arg: str) -> str:
    """A command's word without this machine's paths: relative to the repository, or a placeholder."""
    if not os.path.isabs(arg):
        return arg
    path = Path(arg)
    if path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    return "<python>" if path.name.startswith("python") else f"<{path.name}>"


def begin(command: str | None = None, trials: int | None = None, **extra: Any) -> dict[str, Any]:
    """The stamp's first half, taken before the run."""
    torch = _version("torch")
    return {
        "commit": _git("rev-parse", "--short", "HEAD"),
        "tree_clean": _git("status", "--porcelain", "--untracked-files=no") == "",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": command if command is not None else " ".join(_word(a) for a in ["python", *sys.argv]),
        "trials": trials,
        "python": platform.python_version(),
        "torch": torch,
        "peers": {p: v for p in PEERS if (v := _version(p)) is not None},
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "recovery_path": RECOVERY_PATH,
        "load_before": list(os.getloadavg()),
        "_t0": time.monotonic(),
        **extra,
    }


def end(st: dict[str, Any]) -> dict[str, Any]:
    """The whole stamp, after the run."""
    out = {k: v for k, v in st.items() if k != "_t0"}
    out["load_after"] = list(os.getloadavg())
    out["wall_s"] = round(time.monotonic() - st["_t0"], 1)
    cores = out["cores"] or 1
    out["loaded"] = max(out["load_before"][0], out["load_after"][0]) > cores
    return out


def stamped(data: Any, st: dict[str, Any], complete: bool = True) -> dict[str, Any]:
    """``data`` (a mapping, or anything else under ``results``) with its stamp."""
    body = dict(data) if isinstance(data, dict) else {"results": data}
    return {**body, "stamp": {**end(st), "complete": complete}}


def write(path: Path, data: Any, st: dict[str, Any], complete: bool = True) -> Path:
    """Write ``data`` stamped to ``path``; a partial run whose ``path`` holds a complete result
    goes to ``<stem>.partial.json`` beside it instead. Returns where it went."""
    path = Path(path)
    if not complete and path.exists():
        try:
            before = json.loads(path.read_text()).get("stamp", {})
        except (ValueError, AttributeError):
            before = {}
        if before.get("complete", True):
            path = path.with_name(f"{path.stem}.partial.json")
    path.write_text(scrub(json.dumps(stamped(data, st, complete), indent=1, default=str)) + "\n")
    if complete:  # (a partial run's file, superseded)
        path.with_name(f"{path.stem}.partial.json").unlink(missing_ok=True)
    return path


def scrub(text: str) -> str:
    """``text`` without this machine's paths: the repository's and the interpreter's prefixes."""
    prefixes = {sys.prefix: "<venv>", sys.base_prefix: "<python>", str(ROOT): "."}
    for prefix in sorted(prefixes, key=len, reverse=True):  # (a venv inside the repository: .nox)
        text = text.replace(prefix + "/", prefixes[prefix] + "/")
    return text
