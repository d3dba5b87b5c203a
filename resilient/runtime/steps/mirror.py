"""A rank's step-start capture, mirrored to its node's shared memory at every step, for a
replacement to resume from (handover.py).

It is written at every step, so it is written cheaply: the capture's small part (RNGs, data
position, buffers, hyperparameters, small objects) is a few kilobytes of plain values and a few
tensors. Plain values go through :mod:`marshal` (C, exact for ints, floats, tuples and key order),
tensors and arrays as raw bytes; a part that holds anything else goes through the checkpoint codec.
Two files are written in turn through descriptors kept open, each record with its length, a CRC
and a system-wide monotonic stamp: a death in the middle of a write leaves the other file whole,
and the reader takes the newest whole one. The files live in a directory only this job's
processes write (the launcher's shared-memory directory), so what is read is what a predecessor
wrote; the CRC rejects a torn record before anything is decoded.
"""

from __future__ import annotations

import array
import json
import marshal
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loguru import logger

from resilient.errors import CheckpointError
from resilient.runtime.keeping.resume import pack, unpack
from resilient.runtime.steps.live import _Capture, _Later

FILES = ("live-capture.0.bin", "live-capture.1.bin")
_HEAD = struct.Struct("<4sQII")  # magic, monotonic stamp (ns), payload length, CRC32 of the payload
_MAGIC = b"RLM1"


@dataclass
class Mirrored:
    """A dead rank's last step-start capture, as its mirror holds it."""

    step: int
    seq: int
    generation: int
    pid: int  # the process that wrote it
    large: list[str]  # the models and optimizers, whose state a survivor sends
    small: dict[str, Any]  # the other tracked objects' states
    buffers: dict[str, dict[str, Any]]  # each model's own buffers (and extra state)
    groups: dict[str, list[dict[str, Any]]]  # each optimizer's own hyperparameters
    rng: dict[str, Any]


class LiveMirror:
    """This rank's step-start captures, written to ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.paths = [directory / f for f in FILES]
        self._fds: list[int] | None = None
        self._next = 0
        self._warned = False

    def write(self, cap: _Capture, generation: int) -> None:
        meta: dict[str, Any] = {"step": cap.step, "seq": cap.seq, "generation": generation}
        meta["pid"] = os.getpid()
        record = _record(cap)
        if isinstance(record, str):
            meta["refused"] = record
        else:
            try:
                meta["large"], meta["parts"] = record[0], _encode(record[1])
            except CheckpointError as e:  # (an object the codec does not take: a module's extra state)
                meta = {**meta, "refused": f"not mirrored: {e}"}
        payload = marshal.dumps(meta)
        head = _HEAD.pack(_MAGIC, time.monotonic_ns(), len(payload), zlib.crc32(payload))
        try:
            fds = self._open()
            os.pwrite(fds[self._next], head + payload, 0)
            self._next ^= 1
        except OSError as e:  # (a second line of defence: training goes on without it)
            self.close()
            if not self._warned:
                self._warned = True
                logger.warning(f"the live capture is not mirrored to {self.directory}: {e}")

    def _open(self) -> list[int]:
        if self._fds is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._fds = [os.open(p, os.O_WRONLY | os.O_CREAT, 0o600) for p in self.paths]
        return self._fds

    def close(self) -> None:
        fds, self._fds = self._fds, None
        for fd in fds or ():
            os.close(fd)

    def read(self) -> Mirrored | str:
        """The newest whole capture, or why there is none to offer."""
        newest: tuple[int, bytes] | None = None
        torn = []
        for p in self.paths:
            try:
                raw = p.read_bytes()
            except OSError:
                continue
            got = _whole(raw)
            if isinstance(got, str):
                torn.append(f"{p.name}: {got}")
            elif newest is None or got[0] > newest[0]:
                newest = got
        if newest is None:
            if torn:
                return f"its predecessor's live capture does not parse: {'; '.join(torn)}"
            return f"its predecessor left no live capture in {self.directory}"
        try:
            meta = marshal.loads(newest[1])
            if "refused" in meta:
                return f"its predecessor's capture of step {meta['step']}: {meta['refused']}"
            parts = {k: _decode(v, f"{self.directory}: {k}") for k, v in meta["parts"].items()}
            return Mirrored(
                int(meta["step"]),
                int(meta["seq"]),
                int(meta["generation"]),
                int(meta["pid"]),
                list(meta["large"]),
                parts["small"],
                parts["buffers"],
                parts["groups"],
                _rng_in(parts["rng"]),
            )
        except (CheckpointError, ValueError, KeyError, TypeError, EOFError, RecursionError) as e:
            return f"its predecessor's live capture does not parse: {type(e).__name__}: {e}"


def _whole(raw: bytes) -> tuple[int, bytes] | str:
    """(stamp, payload) of a record that is whole, or what is wrong with it."""
    if len(raw) < _HEAD.size:
        return "shorter than its header"
    magic, stamp, n, crc = _HEAD.unpack_from(raw)
    payload = raw[_HEAD.size : _HEAD.size + n]
    if magic != _MAGIC or len(payload) != n or zlib.crc32(payload) != crc:
        return "torn or not a capture (its length or checksum does not match)"
    return stamp, payload


def _record(cap: _Capture) -> tuple[list[str], dict[str, Any]] | str:
    """The small part of a capture (and the names of the large objects), or why it is not enough."""
    if cap.refused:
        return cap.refused
    small: dict[str, Any] = {}
    buffers: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    large: list[str] = []
    for name, kept in cap.objects.items():
        if kept.state is not None:
            if isinstance(kept.state, _Later):  # (read back from the device only at a restore)
                return f"{name!r}: a device GradScaler is not mirrored at each step"
            if any(t.device.type != "cpu" for t in kept.tensors):
                return f"{name!r}: a carried tensor lives on the device (not read back at each step)"
            small[name] = kept.state
        elif kept.groups is not None:
            groups[name] = kept.groups
            large.append(name)
        else:
            if kept.grads is not None:
                return f"{name!r}: its pending accumulated gradients are the rank's own"
            if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in kept.buffers.values()):
                return f"{name!r}: its buffers live on the device (not read back at each step)"
            buffers[name] = kept.buffers
            large.append(name)
    return large, {"small": small, "buffers": buffers, "groups": groups, "rng": _rng_out(cap.rng)}


# -- the parts: plain values through marshal, the rest through the checkpoint codec -----------------
def _encode(parts: dict[str, dict[str, Any]]) -> dict[str, dict[str, tuple[Any, ...]]]:
    return {part: {name: _piece(v) for name, v in objs.items()} for part, objs in parts.items()}


def _piece(value: Any) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1:
        return ("u8", value.numpy().tobytes())  # (an RNG's or a generator's state)
    try:
        return ("m", marshal.dumps(value))
    except ValueError:  # (tensors, arrays, subclasses of plain types)
        header, buf = pack({"v": value})
        return ("c", json.dumps(header), buf.numpy().tobytes())


def _decode(objs: dict[str, tuple[Any, ...]], where: str) -> dict[str, Any]:
    out = {}
    for name, piece in objs.items():
        tag = piece[0]
        if tag == "u8":
            out[name] = torch.frombuffer(bytearray(piece[1]), dtype=torch.uint8)
        elif tag == "m":
            out[name] = marshal.loads(piece[1])
        elif tag == "c":
            out[name] = unpack(json.loads(piece[1]), piece[2], f"{where}/{name}")["v"]
        else:
            raise CheckpointError(f"{where}/{name}: unknown piece {tag!r}")
    return out


def _rng_out(rng: dict[str, Any]) -> dict[str, Any]:
    """The RNG states as plain values: Python's 625 words as one uint32 array (each is < 2**32),
    NumPy's key as bytes."""
    out = dict(rng)
    version, words, gauss = rng["python"].value
    out["python"] = (version, array.array("I", words).tobytes(), gauss)
    name, key, pos, has_gauss, cached = rng["numpy"].value
    out["numpy"] = (name, np.ascontiguousarray(key, dtype=np.uint32).tobytes(), pos, has_gauss, cached)
    if "cuda" in rng:
        out["cuda"] = [t.numpy().tobytes() for t in rng["cuda"]]
    return out


def _rng_in(rng: dict[str, Any]) -> dict[str, Any]:
    out = dict(rng)
    version, words, gauss = rng["python"]
    out["python"] = (version, tuple(array.array("I", words)), gauss)
    name, key, pos, has_gauss, cached = rng["numpy"]
    out["numpy"] = (name, np.frombuffer(key, dtype=np.uint32).copy(), pos, has_gauss, cached)
    if "cuda" in rng:
        out["cuda"] = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in rng["cuda"]]
    return out
