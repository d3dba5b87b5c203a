"""The launcher's side of the worker↔launcher contract: a dead rank's fault, posted by the agent
through :mod:`resilient.contract` alone, is what the runtime's ``Coordinator`` reads, key for key
and byte for byte."""

from __future__ import annotations

import json

import torch.distributed as dist

from resilient import contract
from resilient.runtime.coordination.coordinator import Coordinator
from resilient.runtime.faults.records import FaultRecord, Severity, Symptom, signature

NS = contract.run_namespace("job", "0")


def test_a_death_record_is_the_fault_record_the_runtime_writes_for_it() -> None:
    cause = "killed by SIGSEGV at 0x7f3a after 12.5 s"
    raw = contract.death_record(3, 2, 40, cause)
    rec = FaultRecord.from_json(raw)
    assert rec.to_json() == raw  # (every field, in the runtime's order)
    ours = FaultRecord(
        rank=3,
        generation=2,
        step=40,
        kind=Symptom.DIED.value,
        severity=Severity.SOFT.value,
        signature=signature(Symptom.DIED, RuntimeError(cause)),
        message=f"worker process of rank 3 {cause}",
        ts=rec.ts,
    )
    assert rec == ours
    assert rec.signature == "died: killed by SIGSEGV at N after N s"


def test_a_death_posted_through_the_contract_is_the_generations_fault_the_coordinator_reads() -> None:
    raw = contract.death_record(1, 4, 7, "exit code 1")
    by_contract, by_runtime = dist.HashStore(), dist.HashStore()
    assert contract.publish_fault(by_contract, NS, 4, 1, raw) == raw.encode()
    Coordinator(by_runtime, NS, -1, 0, 1.0).post_fault(FaultRecord.from_json(raw))
    keys = [contract.generation_key(NS, 4, *k) for k in (("fault",), ("fault", 1), ("done", "release"))]
    assert [by_contract.get(k) for k in keys] == [by_runtime.get(k) for k in keys]
    assert by_contract.get(keys[2]).decode() == contract.FAULTED

    survivor = Coordinator(by_contract, NS, 0, 2, 1.0)
    assert survivor.primary_fault(4) == FaultRecord.from_json(raw)
    assert [o["rank"] for o in survivor.observations(4)] == [1]
    assert json.loads(by_contract.get(keys[0]))["kind"] == contract.DIED
    assert survivor.finish_barrier(4) is False  # a rank that returned recovers with the others
