"""The figures the README and docs/ quote, written from the committed results.

A quoted block sits between two comments, ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->``;
``python -m chaos.figures`` rewrites every block from its result under ``benchmarks/results/``,
``python -m chaos.figures --check`` says which differ (tests/unit/test_figures.py runs it). A
block names its result and the stamp that made it; a result without a stamp says so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# the README certificate table's classes, and what each fault is, in a few words
CERTIFICATE_ROWS = {
    "exception": "raised in the step",
    "hang": "`time.sleep(3600)`",
    "sigkill_warm": "SIGKILL, a standby parked",
    "corrupt_checkpoint": "bytes flipped, job killed",
    "link_drop": "veth link down 10 s",
    "bitflip": "a bit of a weight flipped",
}


# results made before results were stamped (chaos/results.py): kept for the dated records in the
# docs that cite them; no file joins this list, and one made again leaves it
UNSTAMPED = frozenset(
    {
        "buddy_overhead.json",
        "buddy_overhead_auto.json",
        "certificate_compound.json",
        "certificate_cpu_live.json",
        "certificate_cpu_nvrx.json",
        "certificate_cpu_sigkill_warm_handover.json",
        "certificate_live.json",
        "certificate_nodes.json",
        "certificate_pipeline.json",
        "certificate_replay.json",
        "checks_ab_tiny.json",
        "control_plane.json",
        "fsdp2.json",
        "live_overhead_dim160.json",
        "live_under_load.json",
        "lost_node.json",
        "metrics_overhead.json",
        "overhead_ab_env.json",
        "overhead_ab_launch.json",
        "recovery.json",
        "relaunch.json",
        "replace.json",
        "replace_hf.json",
        "replace_prepare.json",
        "work_lost.json",
    }
)


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / name).read_text())
    return data


def made_by(data: dict[str, Any]) -> str:
    """What made a result, in a few words, from its stamp."""
    st = data.get("stamp")
    if not st:
        return "unstamped: made before results were stamped"
    if st.get("from_log"):  # a run that did not end itself, its results taken from what it printed
        return f"partial, torch {st['torch']}: {st['from_log']}"
    tree = "" if st.get("tree_clean") else ", uncommitted changes"
    load = f"load {st['load_before'][0]:.1f}-{st['load_after'][0]:.1f} on {st['cores']} cores"
    return f"{st['date'][:10]}, {st['commit']}{tree}, torch {st['torch']}, {load}"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _slo(slo: dict[str, Any]) -> str:
    """A class's SLO in words: its bounds on detection and recovery, and what else it checks."""
    words = ["caught at its step"] if slo.get("detect_at_step") else []
    detect, recover = slo.get("detect_s"), slo.get("recover_s")
    if detect is not None and detect == recover:
        words.append(f"detect, recover ≤ {recover:g} s")
    else:
        words += [f"{w} ≤ {v:g} s" for w, v in (("detect", detect), ("recover", recover)) if v is not None]
    if slo.get("recover_after_restore_s") is not None:
        words.append(f"≤ {slo['recover_after_restore_s']:g} s after it returns")
    if slo.get("previous_checkpoint_loads"):
        words.append("the previous one loads")
    if slo.get("phase_cpu_p50_s"):
        words.append("each phase's CPU time")
    return "; ".join(words) or "bit-exact"


def certificate_table() -> str:
    """The README's certificate: its classes' detect, recover, SLO and steps lost."""
    name = "certificate_cpu.json"
    data = _load(name)
    rows = {r["class"]: r for r in data["classes"]}
    ran = [r for r in data["classes"] if not r.get("skipped")]
    passed = sum(not r["failed"] for r in ran)
    exact = sum(bool(r["bit_exact"]) for r in ran)
    trials = min((r["trials"] for r in ran), default=0)
    skipped = ", ".join(r["class"] for r in data["classes"] if r.get("skipped")) or "none"
    lines = [
        f"[`{name}`](benchmarks/results/{name}) ({made_by(data)}): {len(ran)} classes, "
        f"{trials}+ trials each, {passed} PASS, {exact} bit-exact (skipped: {skipped}); "
        f"{len(CERTIFICATE_ROWS)} of them:",
        "",
        "| class | the fault | detect p50 / p99 | recover p50 / p99 | SLO | steps lost (max) |",
        "|---|---|---|---|---|---|",
    ]
    for cls, fault in CERTIFICATE_ROWS.items():
        r = rows.get(cls)
        if r is None:
            lines.append(f"| {cls} | {fault} | not in this result | | | |")
            continue
        detect = f"{_s(r['detect_p50'])} / {_s(r['detect_p99'])} s"
        recover = f"{_s(r['recover_p50'])} / {_s(r['recover_p99'])} s"
        if r.get("recover_after_restore_p99") is not None:
            recover += f"; {_s(r['recover_after_restore_p99'])} s (p99) after it returned"
        lines.append(f"| {cls} | {fault} | {detect} | {recover} | {_slo(r['slo'])} | {r['steps_lost_max']} |")
    return "\n".join(lines)


def _verdict(r: dict[str, Any]) -> str:
    return "SKIPPED" if r.get("skipped") else "FAIL: " + ", ".join(r["failed"]) if r["failed"] else "PASS"


def certificate_full() -> str:
    """docs/chaos.md's certificate: every class of the last ``nox -s certify``."""
    name = "certificate_cpu.json"
    data = _load(name)
    lines = [
        f"[`{name}`](../benchmarks/results/{name}) ({made_by(data)}):",
        "",
        "| class | trials | detect p50 / p99 | recover p50 / p99 | SLO | steps lost (max) | bit-exact "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["classes"]:
        if r.get("skipped"):
            lines.append(f"| {r['class']} | — | | | | | | SKIPPED: {r['skipped']} |")
            continue
        detect = f"{_s(r['detect_p50'])} / {_s(r['detect_p99'])} s"
        recover = f"{_s(r['recover_p50'])} / {_s(r['recover_p99'])} s"
        exact = "✓" if r["bit_exact"] else "✗"
        lines.append(
            f"| {r['class']} | {r['finished']}/{r['trials']} | {detect} | {recover} | {_slo(r['slo'])} | "
            f"{r['steps_lost_max']} | {exact} | {_verdict(r)} |"
        )
    return "\n".join(lines)


def stream_run(up: str = "..", indent: str = "") -> Callable[[], str]:
    """The certificate's goodput run (``chaos stream``), its wall time by cause (``indent``: in a
    list item)."""

    def make() -> str:
        name = "stream_cpu.json"
        data = _load(name)
        acc = data["accounting"]
        secs = {k: v for k, v in sorted(acc["seconds"].items(), key=lambda kv: -kv[1]) if v >= 0.005}
        causes = ", ".join(f"{k} {v:.2f} s" for k, v in secs.items())
        kinds = ", ".join(f"{k} ×{v['injected']}" for k, v in data["by_kind"].items())
        verdict = "PASS" if not data["failed"] else "FAIL: " + ", ".join(data["failed"])
        exact = "bit-exact" if data["bit_exact"] else "NOT bit-exact"
        return indent + (
            f"[`{name}`]({up}/benchmarks/results/{name}) ({made_by(data)}): {data['faults_injected']} faults "
            f"({kinds}), {data['steps']} steps, {exact}, {data['lost_committed_checkpoints']} committed "
            f"checkpoints lost; **goodput {data['goodput']:.1%}** of {acc['wall_s']:.1f} s from the "
            f"launch ({verdict} against the config's SLO); by cause: {causes}."
        )

    return make


SYSTEM_NAMES = {
    "resilient": "resilient",
    "torchrun": "torchrun + dcp.async_save",
    "ft_launcher": "NVRx ft_launcher",
    "nvrx": "NVRx in-process Wrapper",
    "torchft": "torchft + Lighthouse",
}


def _cell_text(cell: dict[str, Any], figure: str, digits: int = 2) -> str:
    """A peer's median and range, or what it did instead of recovering, in a few words."""
    if not cell:
        return "not in this result"
    if "skipped" in cell:
        return f"not run: {cell['skipped']}"
    med, rng = (cell.get("median") or {}).get(figure), (cell.get("range") or {}).get(figure)
    if cell["recovered"] < cell["trials"]:
        other = sorted({_instead(o) for o in cell["outcomes"] if o != "recovered"})
        return f"{cell['recovered']}/{cell['trials']} recovered: " + "; ".join(other)
    if med is None:
        return "—"
    if rng is None or rng[0] == rng[1]:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({rng[0]:.{digits}f}–{rng[1]:.{digits}f})"


PEER_FIGURES = (("training lost (s)", "training_lost_s"), ("steps run again", "steps_rerun"))
SHORT_NAMES = {
    "resilient": "resilient",
    "torchrun": "torchrun + DCP async",
    "ft_launcher": "NVRx ft_launcher",
    "nvrx": "NVRx Wrapper",
    "torchft": "torchft",
}

# what a side did instead of recovering (work_lost_peers' outcomes), in a few words
INSTEAD = (
    ("continued as", "went on without the rank"),
    ("never came back", "the rank never came back"),
    ("training stopped", "training stopped"),
    ("not recovered", "not recovered"),
    ("never reached the fault", "never reached the fault"),
    ("harness error", "harness error"),
)


def _instead(outcome: str) -> str:
    return next((words for key, words in INSTEAD if key in outcome), outcome.split(" (")[0])


def readme_comparison() -> str:
    """The README's row per fault: each side's median training lost, or what it did instead."""
    data = _load("suite.json")
    cells, cfg = data["peers"]["cells"], data["peers"]["config"]
    systems = [s for s in SYSTEM_NAMES if any(k.endswith(f"/{s}/2") for k in cells)]
    lines = [
        f"[`suite.json`](benchmarks/results/suite.json) ({made_by_short(data)}), medians of {cfg['trials']} "
        "trials, 2 ranks, 100 ms steps:",
        "",
        "| fault | " + " | ".join(SHORT_NAMES[s] for s in systems) + " |",
        "|---|" + "---|" * len(systems),
    ]
    for fault in ("exception", "hang", "sigkill"):
        row = []
        for s in systems:
            cell = cells.get(f"{fault}/{s}/2", {})
            med = (cell.get("median") or {}).get("training_lost_s")
            if "skipped" in cell:
                row.append("not run")
            elif cell.get("recovered", 0) * 2 <= cell.get("trials", 0) or med is None:
                other = [o for o in cell.get("outcomes", []) if o != "recovered"]
                row.append(", ".join(sorted({_instead(o) for o in other})) or "—")
            else:
                row.append(f"**{med:.2f}**" if s == "resilient" else f"{med:.2f}")
        lines.append(f"| {fault} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _late(cell: dict[str, Any], cfg: dict[str, Any], figure: str, digits: int) -> str:
    """A cell's text, and the steps its fault hit where that was not the planned one (a SIGKILL
    waits for the side to be ready for it: resilient's standby parked)."""
    text = _cell_text(cell, figure, digits)
    hit = [s for s in cell.get("fault_steps", []) if s != cfg["fault_step"]]
    return f"{text}; hit at step {', '.join(map(str, hit))}" if hit else text


def comparison(up: str = "..", figures: tuple[tuple[str, str], ...] = PEER_FIGURES) -> Callable[[], str]:
    """The peers' table of the last ``nox -s bench`` (suite.json): a fault's cost per system."""

    def make() -> str:
        name = "suite.json"
        data = _load(name)
        cells = data["peers"]["cells"]
        cfg = data["peers"]["config"]
        systems = [s for s in SYSTEM_NAMES if any(k.endswith(f"/{s}/2") for k in cells)]
        head = "| fault | figure | " + " | ".join(SYSTEM_NAMES[s] for s in systems) + " |"
        whole = "" if data.get("wall_s") is None else f", the whole run {data['wall_s'] / 60:.0f} min"
        lines = [
            f"[`{name}`]({up}/benchmarks/results/{name}) ({made_by(data)}{whole}): 2 gloo ranks, steps of "
            f"{cfg['step_ms']:g} ms, the fault at "
            f"step {cfg['fault_step']} on the last rank, every side's hang timeout {cfg['timeout']:g} s, "
            f"{cfg['trials']} trials; median (range) over the trials:",
            "",
            head,
            "|---|---|" + "---|" * len(systems),
        ]
        for fault in ("exception", "hang", "sigkill"):
            for label, figure in figures:
                digits = 0 if figure == "steps_rerun" else 2
                row = [_late(cells.get(f"{fault}/{s}/2", {}), cfg, figure, digits) for s in systems]
                lines.append(f"| {fault} | {label} | " + " | ".join(row) + " |")
        return "\n".join(lines)

    return make


def suite_rest() -> str:
    """docs/benchmarks.md: the suite's goodput, overhead, scaling and checkpoint parts."""
    data = _load("suite.json")
    lines = ["The same run ([`suite.json`](../benchmarks/results/suite.json)):", ""]
    gp = data.get("goodput") or {}
    if gp:
        sched = ", ".join(f"{k} at {s}" for s, k in gp["schedule"])
        ours, theirs = gp["resilient"], gp["torchrun"]
        lines.append(
            f"- **Goodput** (productive step time over wall time from the launch) under one seeded "
            f"schedule of {len(gp['schedule'])} faults in a {gp['steps']}-step run ({sched}): "
            f"resilient **{_pct(ours.get('goodput'))}**, torchrun + dcp.async_save "
            f"{_pct(theirs.get('goodput'))} (the runtime's own accounting of the same job: "
            f"{_pct(ours.get('accounting_goodput'))})."
        )
    ov = data.get("overhead") or {}
    if ov:
        lines.append(f"- **Fault-free overhead**: {overhead_line(ov)}")
    for n in data.get("scaling") or []:
        cells = data["peers"]["cells"]
        ours = _cell_text(cells.get(f"exception/resilient/{n}", {}), "training_lost_s")
        theirs = _cell_text(cells.get(f"exception/torchrun/{n}", {}), "training_lost_s")
        lines.append(
            f"- **An exception at {n} ranks**: training lost {ours} s; torchrun + dcp.async_save {theirs} s."
        )
    ckp = data.get("checkpoint") or {}
    if ckp:
        lines += [
            "",
            "| state | copy limit | **ours blocked** | dcp.async_save blocked | torch.save+fsync "
            "| dcp.save | NVRx async blocked (+ the clone a snapshot needs) | ours durable |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for gb in sorted(ckp, key=float):
            r = ckp[gb]
            nv = r.get("nvrx_async") or {}
            nvt = (
                f"{_t(nv.get('block_s'))} ({_t(nv.get('cloned_block_s'))})" if "error" not in nv else "error"
            )
            lines.append(
                f"| {_size(r['bytes'])} | {_t(r['copy_s'])} | **{_t(r['block_s'])}** "
                f"| {_t(r['dcp_async_block_s'])} | {_t(r['torch_save_s'])} | {_t(r['dcp_save_s'])} | {nvt} "
                f"| {_t(r['persist_s'])} |"
            )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def _t(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g} s"


def _size(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"


def overhead_line(ov: dict[str, Any]) -> str:
    lo, hi = ov["overhead_pct_iqr"]
    iqr = "" if lo is None else f"; IQR {lo:+.1f} … {hi:+.1f}%"
    start = ov["startup_s"]
    first = (
        f"; launch → first step {start['resilient']:.2f} s against {start['plain']:.2f} s"
        if start.get("resilient") is not None and start.get("plain") is not None
        else ""
    )
    return (
        f"the whole runtime at its defaults under `resilient launch` against the plain script under "
        f"torchrun, {ov['step_ms']['plain']:.0f} ms steps of compute: **{ov['overhead_pct']:+.1f}%** wall "
        f"time per step{_loops(ov)} (median of {len(ov['overhead_pct_pairs'])} "
        f"interleaved pairs{iqr}){first}.{_overhead_parts_line(ov)}"
    )


def _loops(ov: dict[str, Any], article: str = "") -> str:
    """The loops' length, where the result records it (a run assembled from its log may not)."""
    return f" over {article}{ov['steps']}-step loop{'' if article else 's'}" if "steps" in ov else ""


def _overhead_parts_line(ov: dict[str, Any]) -> str:
    """Where the whole loop's gap goes: the one-off work beside the ranks (the standby's imports,
    the launcher) and the steady step, rank 0's wall and CPU time (results of 2026-12-07 on)."""
    if "steady_overhead_pct" not in ov:
        return ""
    cpu = ov["cpu_s"]
    lo, hi = ov["steady_overhead_pct_iqr"]
    clo, chi = ov["cpu_overhead_pct_iqr"]
    return (
        f" Beside the ranks, CPU seconds per run (median): the standby's imports "
        f"{cpu['resilient']['standby']:.1f} s, the launcher {cpu['resilient']['launcher']:.1f} s "
        f"(torchrun's {cpu['plain']['launcher']:.1f} s): one-off work that shares the cores with the "
        f"loop's first steps. Over the loop's second half (the standby waiting): "
        f"**{ov['steady_overhead_pct']:+.1f}%** wall time per step (IQR {lo:+.1f} … {hi:+.1f}%); "
        f"rank 0's own CPU time per step over the whole loop {ov['cpu_overhead_pct']:+.1f}% "
        f"(IQR {clo:+.1f} … {chi:+.1f}%)."
    )


def overhead_readme() -> str:
    data = _load("suite.json")
    ov = data["overhead"]
    lo, hi = ov["overhead_pct_iqr"]
    steady = (
        f", **{ov['steady_overhead_pct']:+.1f}%** over their second half (the standby's one-off imports done)"
        if "steady_overhead_pct" in ov
        else ""
    )
    return (
        f"A fault-free step: **{ov['overhead_pct']:+.1f}%** wall time per {ov['step_ms']['plain']:.0f} ms "
        f"step{_loops(ov)}{steady}: the whole runtime at its defaults vs the plain script "
        f"({len(ov['overhead_pct_pairs'])} interleaved pairs, IQR {lo:+.1f} … {hi:+.1f}%; same "
        f"run, [`suite.json`](benchmarks/results/suite.json))."
    )


def made_by_short(data: dict[str, Any]) -> str:
    """What made a result, for the README: a run not complete says so and points at its stamp."""
    st = data.get("stamp") or {}
    if st.get("from_log"):
        return (
            f"partial: a run of {st['date'][:10]} taken from its log, its stamp says why; torch {st['torch']}"
        )
    return made_by(data)


def overhead_parts() -> str:
    """docs/benchmarks.md: where the whole runtime's fault-free overhead goes (overhead_parts.py):
    per configuration, rank 0's wall time per step over the loop and its second half, and its CPU
    time per step, each the median over the rounds against the plain script's."""
    name = "overhead_parts.json"
    data = _load(name)
    lines = [
        f"[`{name}`](../benchmarks/results/{name}) ({made_by(data)}), {data['rounds']} interleaved "
        f"rounds of {data['steps']} steps, the order rotating; medians over the rounds, rank 0:",
        "",
        "| run | ms/step, whole loop | vs plain | vs plain, second half | CPU ms/step | vs plain |",
        "|---|---|---|---|---|---|",
    ]
    for n, p in data["parts"].items():
        wall, cpu = p["wall"]["ms"], p["cpu"]["ms"]
        lines.append(
            f"| {OVERHEAD_PARTS.get(n, n)} | {'—' if wall is None else f'{wall:.1f}'} | {_vs(p, 'wall', n)} "
            f"| {_vs(p, 'steady', n)} | {'—' if cpu is None else f'{cpu:.1f}'} | {_vs(p, 'cpu', n)} |"
        )
    return "\n".join(lines)


def _vs(part: dict[str, Any], figure: str, name: str) -> str:
    v = part[figure]["vs_plain_pct"]
    return "—" if v is None or name == "plain" else f"{v:+.1f}%"


OVERHEAD_PARTS = {
    "plain": "the plain script, torchrun",
    "defaults": "resilient launch, every default",
    "live": "… live capture off",
    "guard": "… step guard off",
    "sdc": "… replica digests off",
    "replay": "… replay digest off",
    "count": "… collective count off",
    "straggler": "… straggler watch off",
    "all": "… all six off",
    "standby": "resilient launch --standby 0, every other default",
    "torchrun": "the runtime's defaults under torchrun (no launcher)",
}


# block name -> (the files it is in, its generator, the results it is made from)
BLOCKS: dict[str, tuple[tuple[str, ...], Callable[[], str], tuple[str, ...]]] = {
    "certificate": (("README.md",), certificate_table, ("certificate_cpu.json",)),
    "certificate_full": (("docs/chaos.md",), certificate_full, ("certificate_cpu.json",)),
    "stream": (("docs/chaos.md",), stream_run(), ("stream_cpu.json",)),
    "stream_live": (("docs/recovery.md",), stream_run(indent="  "), ("stream_cpu.json",)),
    "comparison": (("docs/benchmarks.md",), comparison(), ("suite.json",)),
    "comparison_readme": (("README.md",), readme_comparison, ("suite.json",)),
    "suite_rest": (("docs/benchmarks.md",), suite_rest, ("suite.json",)),
    "overhead": (("README.md",), overhead_readme, ("suite.json",)),
    "overhead_parts": (("docs/benchmarks.md",), overhead_parts, ("overhead_parts.json",)),
}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- figures:{name} -->\n)(.*?)(<!-- /figures:{name} -->)", re.S)


def render(text: str, name: str, body: str) -> str:
    """``text`` with block ``name`` holding ``body``; a file without the block is an error."""
    pattern = _pattern(name)
    if not pattern.search(text):
        raise ValueError(f"no block <!-- figures:{name} --> ... <!-- /figures:{name} -->")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1)


def stale() -> list[str]:
    """The blocks whose text differs from their result's, or whose result is not of the current
    recovery path (resilient.runtime.RECOVERY_PATH)."""
    from resilient.runtime import RECOVERY_PATH

    out = []
    for name, (docs, make, sources) in BLOCKS.items():
        body = make()
        for doc in docs:
            text = (ROOT / doc).read_text()
            if render(text, name, body) != text:
                out.append(f"{doc}: {name} differs from its result (python -m chaos.figures)")
        for src in sources:
            version = (_load(src).get("stamp") or {}).get("recovery_path")
            if version != RECOVERY_PATH:
                said = f"{src} was made by recovery path {version}, the code is {RECOVERY_PATH}"
                out.append(f"{name}: {said}: run it again")
    return out


NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\d.+])")  # ("2.13+" is a version)
RESULT_LINK = re.compile(r"benchmarks/results/([\w./-]+\.json)")
VERSION_WORDS = re.compile(r"(torch|python|nvidia-resiliency-ext|torchft|NVRx|Python|version)\s*$", re.I)


def _leaves(obj: Any, out: list[float]) -> list[float]:
    if isinstance(obj, dict):
        for v in obj.values():
            _leaves(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _leaves(v, out)
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        out.append(float(obj))
    return out


def _matches(quoted: str, values: list[float]) -> bool:
    """Whether a decimal as the text shows it is one of the result's values at that precision
    (as it is, as a percentage, in ms, or ms in s)."""
    digits, x = len(quoted.split(".")[1]), float(quoted)
    return any(round(abs(v) * k, digits) == x for v in values for k in (1.0, 100.0, 1000.0, 0.001))


def unsourced() -> list[str]:
    """Decimals in a paragraph of README.md or docs/ that names a result under
    benchmarks/results/ (outside the generated blocks) that are none of its values: a figure
    with no source, or one that differs from it. Version numbers (torch 2.13) are words."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"<!-- figures:(\w+) -->.*?<!-- /figures:\1 -->", "", doc.read_text(), flags=re.S)
        for para in re.split(r"\n\s*\n", text):
            files = sorted(set(RESULT_LINK.findall(para)))
            values: list[float] = []
            for f in files:
                if (RESULTS / f).exists():
                    _leaves(json.loads((RESULTS / f).read_text()), values)
            for m in NUMBER.finditer(para) if files else ():
                if VERSION_WORDS.search(para[max(0, m.start() - 30) : m.start()]):
                    continue
                if not _matches(m.group(1), values):
                    where = " ".join(para[max(0, m.start() - 40) : m.end() + 10].split())
                    out.append(
                        f"{doc.relative_to(ROOT)}: {m.group(1)} is in none of {', '.join(files)}: …{where}…"
                    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="say which blocks differ; write nothing")
    args = p.parse_args(argv)
    if args.check:
        problems = stale() + unsourced()
        for d in problems:
            print(d)
        return 1 if problems else 0
    for name, (docs, make, _) in BLOCKS.items():
        body = make()
        for doc in docs:
            path = ROOT / doc
            path.write_text(render(path.read_text(), name, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
