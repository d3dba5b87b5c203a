"""Fault classification and signatures: what decides recover-in-place vs exit, and repeat detection."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from resilient.errors import StepInterrupted
from resilient.runtime.faults.records import FaultRecord, Severity, Symptom, classify, signature

GLOO_CLOSED = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"
)
GLOO_TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1500ms "
    "for recv operation to complete"
)


def sig_of(exc: BaseException) -> str:
    kind, _ = classify(exc)
    return signature(kind, exc)


def test_torch_out_of_memory_error_is_soft_oom():
    assert classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == (
        Symptom.OOM,
        Severity.SOFT,
    )


def test_real_host_allocation_failure_is_soft_oom():
    with pytest.raises(RuntimeError, match="can't allocate memory") as ei:
        torch.empty(10**15, dtype=torch.uint8)
    assert classify(ei.value) == (Symptom.OOM, Severity.SOFT)


def test_python_memory_error_is_oom():
    assert classify(MemoryError()) == (Symptom.OOM, Severity.SOFT)


@pytest.mark.parametrize(
    "msg", [GLOO_CLOSED, GLOO_TIMEOUT, "Connection closed by peer [10.0.0.1]:4000", "Broken pipe"]
)
def test_gloo_failures_are_soft_collective(msg: str):
    assert classify(RuntimeError(msg)) == (Symptom.COLLECTIVE, Severity.SOFT)


def test_dist_backend_error_is_collective_by_type():
    # no collective keyword in the message: the type alone decides
    exc = dist.DistBackendError("something went wrong")
    assert classify(exc) == (Symptom.COLLECTIVE, Severity.SOFT)


def test_sticky_cuda_error_is_hard():
    exc = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert classify(exc) == (Symptom.CUDA, Severity.HARD)


def test_device_side_assert_is_hard():
    exc = RuntimeError("CUDA error: device-side assert triggered")
    assert classify(exc) == (Symptom.CUDA, Severity.HARD)


def test_cuda_out_of_memory_is_soft_oom_not_sticky():
    assert classify(RuntimeError("CUDA error: out of memory")) == (Symptom.OOM, Severity.SOFT)


def test_plain_user_exception_is_soft_exception():
    assert classify(ValueError("bad label 7")) == (Symptom.EXCEPTION, Severity.SOFT)


def test_step_interrupted_hang_and_peer():
    assert classify(StepInterrupted("hang: no progress for 61.0s")) == (Symptom.HANG, Severity.SOFT)
    assert classify(StepInterrupted("peer: rank 1 faulted")) == (Symptom.PEER, Severity.SOFT)


def test_signature_ignores_volatile_numbers_ports_and_addresses():
    a = RuntimeError(GLOO_CLOSED)
    b = RuntimeError(GLOO_CLOSED.replace("[127.0.0.1]:29500", "[10.1.2.3]:41877").replace(":534]", ":612]"))
    assert sig_of(a) == sig_of(b)
    v6 = RuntimeError("Connection closed by peer [::1]:29500")
    assert sig_of(v6) == sig_of(RuntimeError("Connection closed by peer [fe80::2]:41877"))
    t1 = RuntimeError("Timed out waiting 1500ms for recv operation")
    t2 = RuntimeError("Timed out waiting 30000ms for recv operation")
    assert sig_of(t1) == sig_of(t2)
    p1 = ValueError("bad pointer 0x7f3a2c001000 at step 12")
    p2 = ValueError("bad pointer 0x55d1e0a3b9c0 at step 931")
    assert sig_of(p1) == sig_of(p2)


def test_signature_distinguishes_types_and_kinds():
    assert sig_of(ValueError("boom")) != sig_of(KeyError("boom"))
    assert sig_of(ValueError("boom")) != sig_of(ValueError("bang"))
    assert sig_of(StepInterrupted("hang: x")) != sig_of(StepInterrupted("peer: x"))
    s = sig_of(ValueError("boom 3"))
    assert s.startswith("exception: ValueError: ")


def test_signature_uses_only_first_line_and_is_bounded():
    a = RuntimeError("first line\nstack frame 1\nstack frame 2")
    b = RuntimeError("first line\nother frames")
    assert sig_of(a) == sig_of(b)
    assert len(sig_of(ValueError("x" * 10_000))) < 220


def test_fault_record_from_exception_and_json_round_trip():
    rec = FaultRecord.from_exception(RuntimeError(GLOO_CLOSED), rank=3, generation=2, step=17)
    assert (rec.rank, rec.generation, rec.step) == (3, 2, 17)
    assert rec.kind == "collective" and rec.severity == "soft"
    assert rec.message.startswith("RuntimeError: ")
    back = FaultRecord.from_json(rec.to_json())
    assert back == rec
    assert FaultRecord.from_json(rec.to_json().encode()) == rec


def test_fault_record_message_is_truncated():
    rec = FaultRecord.from_exception(ValueError("y" * 5000), rank=0, generation=0, step=None)
    assert len(rec.message) <= len("ValueError: ") + 500
    assert FaultRecord.from_json(rec.to_json()).step is None


def test_a_fault_wrapped_by_a_framework_is_classified_by_what_it_was_raised_from():
    # torch.distributed.pipelining re-raises what a stage's forward or backward raised as
    # RuntimeError("Stage 1 failed to run forward") from e: an OOM stays an OOM, named in the message
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError as e:
            raise RuntimeError("[Stage 1] failed to run backward for microbatch 2") from e
    except RuntimeError as wrapped:
        rec = FaultRecord.from_exception(wrapped, rank=1, generation=0, step=12)
    assert (rec.kind, rec.severity) == ("oom", "soft"), rec
    assert rec.signature.startswith("oom: OutOfMemoryError") and "from OutOfMemoryError" in rec.message
    # a plain wrapper of a plain error stays an exception, signed by the wrapper
    try:
        try:
            raise ValueError("bad batch")
        except ValueError as e:
            raise RuntimeError("[Stage 0] failed to run forward") from e
    except RuntimeError as wrapped:
        assert classify(wrapped) == ("exception", Severity.SOFT)
