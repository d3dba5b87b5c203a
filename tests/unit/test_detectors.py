"""Detectors are entries in a registry: a new one is one class and one entry, and the config,
the fault records, the classification and the step loop's hooks follow from the registry."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from pydantic import Field

from resilient.config import Config, load_config
from resilient.detectors import REGISTRY, Detector, DetectorRegistry, Run
from resilient.errors import ConfigError, SoftFault
from resilient.events import Event, read_events
from resilient.launch_env import LaunchEnv
from resilient.runtime.engine.builtin import BuiltinEngine
from resilient.runtime.faults import records as faults
from resilient.runtime.faults.records import FaultRecord, classify, signature
from resilient.runtime.run.wiring import Setup
from resilient.sections import Section
from tests.unit.test_core import Fakes, _train


def test_each_detectors_section_is_a_field_of_the_config_with_its_own_model() -> None:
    for d in REGISTRY.values():
        field = Config.model_fields[d.section]
        assert field.annotation is d.config, d.name
        assert d.section_of(load_config(None)) == (
            d.config_default if d.config_default is not None else d.config()
        )
    with pytest.raises(ConfigError, match=r"guard\.spike"):
        load_config(None, guard={"spike": -1})  # (validated by the detector's own model)


def test_each_detectors_faults_are_classified_and_recorded_by_what_their_class_says() -> None:
    for cls in REGISTRY.faults():
        assert cls.symptom in faults.kinds()
        exc = cls.__new__(cls)
        Exception.__init__(exc, "x")
        assert classify(exc) == (cls.symptom, faults.Severity(cls.severity))
        rec = FaultRecord(rank=0, generation=0, step=1, kind=cls.symptom, severity=cls.severity,
                          signature=signature(cls.symptom, exc), message="x")  # fmt: skip
        assert FaultRecord.from_json(rec.to_json()) == rec  # (a peer's record of it parses)


# -- a detector added in one class: the registry does the rest -----------------------------------------
class Stalled(SoftFault):
    """The toy detector's fault (a real one would say what it saw)."""

    symptom: ClassVar[str] = "toy"
    signature_text: ClassVar[str] = "toy: the toy detector fired"


class ToyConfig(Section):
    at_step: int = Field(5, ge=0, description="the step whose end it refuses, in generation 0")


class Toy(Detector):
    """Refuses the end of one step in the first generation; records every hook it is called at."""

    name = "toy"
    summary = "a test's detector"
    section = "toy"
    config = ToyConfig
    faults = (Stalled,)
    seen: ClassVar[list[tuple[Any, ...]]] = []

    @classmethod
    def build(cls, section: ToyConfig, run: Run) -> Toy:
        return cls(section, run)

    def __init__(self, cfg: ToyConfig, run: Run) -> None:
        self.cfg, self.run = cfg, run

    def generation(self, number: int) -> None:
        self.seen.append(("generation", number))

    def tracked(self, name: str, obj: Any) -> None:
        self.seen.append(("tracked", name))

    def restored(self, step: int) -> None:
        self.seen.append(("restored", step))

    def recovering(self, fault: Any, history: list[dict[str, object]]) -> None:
        self.seen.append(("recovering", fault.kind))

    def step_done(self, step: int) -> None:
        if self.run.generation == 0 and step == self.cfg.at_step:
            raise Stalled(f"step {step} refused by the toy")


def test_a_detector_in_one_class_and_one_entry_is_built_hooked_and_recovered_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = DetectorRegistry([*REGISTRY.values(), Toy])
    monkeypatch.setattr(faults, "DETECTORS", registry)  # (as if listed in resilient/detectors/__init__.py)
    Toy.seen = []
    fakes, ref = Fakes(tmp_path / "toy"), Fakes(tmp_path / "ref")
    cfg = load_config(None, snapshot={"interval": 1}, health={"checks": ["host_memory", "store"]})

    def engine(f: Fakes, reg: DetectorRegistry) -> BuiltinEngine:
        return BuiltinEngine(Setup.of(cfg, launch=LaunchEnv.from_environ({}), detectors=reg), wiring=f.wiring)

    got = engine(fakes, registry).run(_train(engine(fakes, registry), lambda g, s: False))
    want = engine(ref, REGISTRY).run(_train(engine(ref, REGISTRY), lambda g, s: False))
    assert all(torch.equal(got[k], want[k]) for k in want)  # (recovered, and bit-exact)
    (detected,) = [
        e for e in read_events(tmp_path / "toy" / "unit" / "events.jsonl") if e["event"] == "fault_detected"
    ]
    assert detected["kind"] == "toy" and detected["signature"] == "toy: the toy detector fired"
    assert ("recovering", "toy") in Toy.seen and ("restored", 5) in Toy.seen
    assert [s for s in Toy.seen if s[0] == "generation"] == [("generation", 0), ("generation", 1)]
    assert ("tracked", "opt") in Toy.seen


def test_what_a_detectors_fault_declares_is_what_the_runtime_and_the_metrics_take() -> None:
    class Doubted(SoftFault):
        symptom: ClassVar[str] = "doubted"
        rolls_back: ClassVar[bool] = True
        doubts_state: ClassVar[str | None] = "the toy doubts it"
        peers_finish_step: ClassVar[bool] = True

    class Doubting(Toy):
        name, section, faults = "doubting", "doubting", (Doubted,)
        evidence = (Event.SPIKE_ACCEPTED,)

    registry = DetectorRegistry([*REGISTRY.values(), Doubting])
    assert "doubted" in registry.symptoms(lambda f: f.rolls_back)  # (goodput's rollback cause)
    assert "doubted" in registry.symptoms(lambda f: f.peers_finish_step)  # (a peer finishes its step)
    assert registry.doubts()["doubted"] == "the toy doubts it"  # (no live resume after it)
    assert "doubted" in registry.evidenced_by(Event.SPIKE_ACCEPTED)  # (the report's verdict lines)
    # the built-in ones come from their own files alone
    from resilient.metrics.accounting import ROLLBACK_KINDS
    from resilient.runtime.leave.notice import TAIL_KINDS
    from resilient.runtime.steps.live import DOUBTS

    assert {"nonfinite", "spike", "sdc"} == ROLLBACK_KINDS and {"nonfinite", "spike"} <= TAIL_KINDS
    assert set(DOUBTS) == {"sdc", "desync", "malformed"}


# the detector modules the rest of the library may still name, and why; every other one (the
# guard: the example docs/architecture.md gives) is reached only through REGISTRY
NAMED_OUTSIDE = {
    "collectives": "the collective count is the window that kept state rides (runtime/steps/kept.py)",
    "replicas": "its digests ride that window, and the recovery attributes a corrupt replica",
    "stragglers": "the built-in engine's watch thread reads its section",
    "straggler_watch": "that thread itself",
    "p2p": "the group's owner refuses new point-to-point ops after an abort (coordination/pg.py)",
}


def test_no_module_outside_the_detectors_names_a_detector_but_the_kept_states() -> None:
    import ast

    root = Path(__file__).resolve().parents[2]
    modules = {p.stem for p in (root / "resilient" / "detectors").glob("*.py")} - {"__init__", "base"}
    named: dict[str, list[str]] = {}
    for path in sorted((root / "resilient").rglob("*.py")):
        if path.parent.name == "detectors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for m in mods:
                parts = m.split(".")
                if parts[:2] == ["resilient", "detectors"] and len(parts) == 3 and parts[2] in modules:
                    named.setdefault(parts[2], []).append(str(path.relative_to(root)))
    extra = {m: where for m, where in named.items() if m not in NAMED_OUTSIDE}
    assert not extra, f"detector modules named outside resilient/detectors/ (reach them by REGISTRY): {extra}"
    stale = sorted(set(NAMED_OUTSIDE) - set(named))
    assert not stale, f"named nowhere outside now: remove from NAMED_OUTSIDE: {stale}"
    assert "guard" not in named
