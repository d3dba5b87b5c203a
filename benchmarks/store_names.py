"""Does this torch still ask the resolver for its store peers' names? (``resilient/native/names.py``)

Builds ``benchmarks/native/getnameinfo_spy.c`` (an ``LD_PRELOAD`` interposer that prints the
library calling ``getnameinfo`` and whether it asked for ``NI_NUMERICHOST``), then, in each given
interpreter, starts a ``TCPStore`` server and one client under it, twice: plain, and after
``names.apply()``. A torch whose calls carry ``NI_NUMERICHOST`` needs no patch; one whose calls do
not does, and after ``apply()`` the same calls carry it (the patched slot's version adds the flag
and passes the call on, here to the interposer).

    python benchmarks/store_names.py --python venv-a/bin/python venv-b/bin/python \\
        --out benchmarks/results/store_names.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROBE = """
import datetime, sys, torch, torch.distributed as dist
if sys.argv[1] == "apply":
    from resilient.native import names
    print("apply:", names.apply(), file=sys.stderr)
t = datetime.timedelta(seconds=10)
s = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=t, wait_for_workers=False)
c = dist.TCPStore("127.0.0.1", s.port, 2, False, timeout=t)
c.set("k", "v")
assert s.get("k") == b"v"
print("torch:", torch.__version__, file=sys.stderr)
"""


def _spy(build: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("store_names: no C compiler to build the interposer")
    out = build / "spy.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(HERE / "native" / "getnameinfo_spy.c"), "-ldl"],
        check=True,
    )
    return out


def _probe(python: str, spy: Path, mode: str) -> dict[str, Any]:
    env = {**os.environ, "LD_PRELOAD": str(spy), "PYTHONPATH": str(HERE.parent), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([python, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"store_names: {python} {mode}: {done.stderr[-2000:]}")
    calls: Counter[str] = Counter()
    torch_version, applied = "", None
    for line in done.stderr.splitlines():
        if line.startswith("getnameinfo "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            calls[f"{fields['caller']} numerichost={fields['numerichost']}"] += 1
        elif line.startswith("torch: "):
            torch_version = line.split(": ", 1)[1]
        elif line.startswith("apply: "):
            applied = line.split(": ", 1)[1]
    return {"torch": torch_version, "calls": dict(calls), "apply": applied}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", nargs="+", default=[sys.executable], help="interpreters, each with its torch")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from chaos import results

    st = results.begin()
    with tempfile.TemporaryDirectory() as build:
        spy = _spy(Path(build))
        rows = []
        for python in args.python:
            plain, patched = _probe(python, spy, "plain"), _probe(python, spy, "apply")
            lookups = sum(n for k, n in plain["calls"].items() if k.endswith("numerichost=0"))
            rows.append(
                {
                    "torch": plain["torch"],
                    "plain": plain["calls"],
                    "after_apply": patched["calls"],
                    "apply_said": patched["apply"],
                    "needs_patch": lookups > 0,
                }
            )
            print(json.dumps(rows[-1]))
    if args.out is not None:
        results.write(args.out, rows, st)
    return 0


if __name__ == "__main__":
    sys.exit(main())
