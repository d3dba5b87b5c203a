"""Sharded state (DTensor, FSDP2) through torch.distributed.checkpoint, with JSON metadata.

DCP reshards on load (written at world size 4, read at 2), which is why sharded state goes
through it. But stock DCP reads its ``.metadata`` with ``pickle.load`` and non-tensor entries with
``torch.load(weights_only=False)``: a checkpoint file could run code. Our rule is that nothing
from a checkpoint is unpickled, so the writer here stores the metadata as JSON (explicit encoder
and decoder for the handful of DCP dataclasses), tensors load with ``weights_only=True`` as in
stock DCP, and non-tensor entries load with ``weights_only=True`` too (or fail as a
:class:`CheckpointError`). Objects still cross the process group pickled during the collective
planning; that is peer-to-peer traffic of the same job, not checkpoint content.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from resilient.checkpoint.manifest import fsync_dir
from resilient.errors import CheckpointError

METADATA_FILE = ".metadata.json"
_FORMAT = "resilient.dcp-metadata/1"
_T = TypeVar("_T")

# The fields the codec below knows. A torch upgrade that adds one must fail loudly, not drop it.
_KNOWN_FIELDS: dict[type, set[str]] = {
    Metadata: {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"},
    TensorStorageMetadata: {"properties", "size", "chunks"},
    TensorProperties: {"dtype", "layout", "requires_grad", "memory_format", "pin_memory"},
    ChunkStorageMetadata: {"offsets", "sizes"},
    BytesStorageMetadata: set(),
    MetadataIndex: {"fqn", "offset", "index"},
    _StorageInfo: {"relative_path", "offset", "length", "transform_descriptors"},
    StorageMeta: {"checkpoint_id", "save_id", "load_id", "modules"},
}
# Fields a newer torch has that the codec writes and reads when they are there (torch 2.15's
# TensorProperties.strides: the saved tensor's strides, a layout hint; a torch without the field
# reads the values by their chunks all the same).
_OPTIONAL_FIELDS: dict[type, set[str]] = {TensorProperties: {"strides"}}


def save_sharded(
    state_dict: dict[str, Any], directory: Path | str, *, process_group: dist.ProcessGroup | None = None
) -> list[str]:
    """Write ``state_dict`` with DCP into ``directory``; collective over ``process_group``.

    Returns the files this rank wrote, relative to ``directory`` (the coordinator's list includes
    :data:`METADATA_FILE`), so the caller can checksum them into its manifest. Files are fsynced;
    making the directory visible atomically is the caller's job.
    """
    root = Path(directory)
    writer = _JsonMetadataWriter(root)
    try:
        dcp.save(state_dict, storage_writer=writer, process_group=process_group)
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        raise CheckpointError(f"saving sharded state to {root} failed: {e}") from e
    fsync_dir(root)
    return sorted({str(p.relative_to(root)) for p in writer.recorder.written})


def load_sharded(
    state_dict: dict[str, Any], directory: Path | str, *, process_group: dist.ProcessGroup | None = None
) -> None:
    """Load ``directory`` into ``state_dict`` in place, resharding to the current layout; collective."""
    reader = _JsonMetadataReader(Path(directory))
    try:
        dcp.load(
            state_dict, storage_reader=reader, planner=_WeightsOnlyLoadPlanner(), process_group=process_group
        )
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        # DCP swallows read_metadata's error into an AssertionError; surface ours, which names the file.
        if reader.metadata_error is not None:
            raise CheckpointError(str(reader.metadata_error)) from reader.metadata_error
        raise CheckpointError(f"loading sharded state from {directory} failed: {e}") from e


class _RecordingFileSystem(FileSystem):
    """DCP's local file system, remembering every file it opened for writing (even empty ones)."""

    def __init__(self) -> None:
        self.written: list[Path] = []
        self._lock = threading.Lock()  # DCP may write from several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "r" not in mode:
            with self._lock:
                self.written.append(Path(path))
        with super().create_stream(path, mode) as stream:
            yield stream


class _JsonMetadataWriter(dcp.FileSystemWriter):
    """Writes data files like stock DCP (fsynced), and the metadata as JSON instead of a pickle."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.recorder = _RecordingFileSystem()
        self.fs = self.recorder

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        payload = json.dumps(_encode(metadata), separators=(",", ":")).encode()
        with self.fs.create_stream(Path(self.path) / METADATA_FILE, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())


class _JsonMetadataReader(dcp.FileSystemReader):
    """Reads the JSON metadata; refuses a planner that would unpickle non-tensor entries."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.metadata_error: CheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata_error is not None:  # DCP retries with rank=...; we never write per-rank files
            raise self.metadata_error
        path = Path(self.path) / METADATA_FILE
        try:
            metadata = _decode(json.loads(path.read_bytes()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self.metadata_error = CheckpointError(f"cannot read DCP metadata {path}: {e!r}")
            raise self.metadata_error from e
        metadata.storage_meta = dataclasses.replace(
            metadata.storage_meta or StorageMeta(), load_id=self.load_id
        )
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, _WeightsOnlyLoadPlanner) and any(
            item.type == LoadItemType.BYTE_IO for item in plan.items
        ):
            raise CheckpointError(
                "non-tensor entries need _WeightsOnlyLoadPlanner (stock DCP unpickles them)"
            )
        return super().read_data(plan, planner)


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor entries load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise CheckpointError(f"entry {fqn!r} does not load with weights_only=True: {e}") from e
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _check_known_fields() -> None:
    for cls, names in _KNOWN_FIELDS.items():
        actual = {f.name for f in dataclasses.fields(cls)}
        if not names <= actual or not actual - names <= _OPTIONAL_FIELDS.get(cls, set()):
            raise CheckpointError(
                f"torch's {cls.__name__} has fields {sorted(actual)}, codec knows {sorted(names)}"
            )


def _name(value: object) -> str:
    return str(value).removeprefix("torch.")


def _torch_constant(name: object, kind: type[_T]) -> _T:
    """``torch.<name>`` if it is a ``kind`` (dtype, layout, memory format); never imports anything."""
    value = vars(torch).get(name) if isinstance(name, str) else None
    if not isinstance(value, kind):
        raise ValueError(f"not a torch.{kind.__name__}: {name!r}")
    return value


def _typed(value: Any, kind: type[_T]) -> _T:
    """``value`` if its type is exactly ``kind`` (a JSON ``true`` is no int), else a ``TypeError``."""
    if type(value) is not kind:
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value


def _opt(value: Any, kind: type[_T]) -> _T | None:
    return None if value is None else _typed(value, kind)


def _list_of(value: Any, *kinds: type) -> list[Any]:
    if type(value) is not list or not all(type(v) in kinds for v in value):
        raise TypeError(f"expected a list of {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def _size(value: Any) -> torch.Size:
    return torch.Size(_list_of(value, int))


def _file_name(value: Any) -> str:
    """Data files sit next to the metadata: a path elsewhere (``../x``, ``/x``) is refused."""
    if type(value) is not str or value in ("", ".", "..") or Path(value).name != value:
        raise ValueError(f"not a file name in the checkpoint directory: {value!r}")
    return value


def _strides_of(p: TensorProperties) -> dict[str, Any]:
    """``{"strides": ...}`` where this torch's properties have them, else nothing."""
    if not hasattr(p, "strides"):
        return {}
    return {"strides": None if p.strides is None else list(p.strides)}


def _strides_for(item: dict[str, Any]) -> dict[str, Any]:
    """The ``strides`` keyword for this torch's ``TensorProperties``: none where it has no such
    field (a file from a newer torch: the hint is dropped), ``None`` where the file has none."""
    if "strides" not in {f.name for f in dataclasses.fields(TensorProperties)}:
        return {}
    strides = item.get("strides")
    return {"strides": None if strides is None else tuple(_list_of(strides, int))}


def _encode(md: Metadata) -> dict[str, Any]:
    _check_known_fields()  # on save only: a newer torch reads our files; it must not write lossy ones
    items: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            items[fqn] = {"type": "bytes"}
            continue
        p = item.properties
        items[fqn] = {
            "type": "tensor",
            "dtype": _name(p.dtype),
            "layout": _name(p.layout),
            "memory_format": _name(p.memory_format),
            "requires_grad": p.requires_grad,
            "pin_memory": p.pin_memory,
            **_strides_of(p),
            "size": list(item.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks],
        }
    storage = [
        {
            "fqn": idx.fqn,
            "offset": None if idx.offset is None else list(idx.offset),
            "index": idx.index,
            "path": info.relative_path,
            "byte_offset": info.offset,
            "length": info.length,
            "transforms": None if info.transform_descriptors is None else list(info.transform_descriptors),
        }
        for idx, info in (md.storage_data or {}).items()
    ]
    sm = md.storage_meta or StorageMeta()
    ckpt_id = None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id)
    return {
        "format": _FORMAT,
        "version": md.version,
        "state_dict_metadata": items,
        "planner_data": None if md.planner_data is None else {k: list(v) for k, v in md.planner_data.items()},
        "storage_data": storage,
        "storage_meta": {"checkpoint_id": ckpt_id, "save_id": sm.save_id, "modules": list(sm.modules)},
    }


def _decode(obj: Any) -> Metadata:
    if _typed(obj, dict).get("format") != _FORMAT:
        raise ValueError(f"not {_FORMAT!r} metadata")
    items: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, item in _typed(obj["state_dict_metadata"], dict).items():
        if item["type"] == "bytes":
            items[fqn] = BytesStorageMetadata()
            continue
        if item["type"] != "tensor":
            raise ValueError(f"unknown item type {item['type']!r} for {fqn!r}")
        props = TensorProperties(
            dtype=_torch_constant(item["dtype"], torch.dtype),
            layout=_torch_constant(item["layout"], torch.layout),
            requires_grad=_typed(item["requires_grad"], bool),
            memory_format=_torch_constant(item["memory_format"], torch.memory_format),
            pin_memory=_typed(item["pin_memory"], bool),
            **_strides_for(item),
        )
        chunks = [ChunkStorageMetadata(_size(c["offsets"]), _size(c["sizes"])) for c in item["chunks"]]
        items[fqn] = TensorStorageMetadata(props, _size(item["size"]), chunks)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for e in _typed(obj["storage_data"], list):
        offset = None if e["offset"] is None else _size(e["offset"])
        index = MetadataIndex(_typed(e["fqn"], str), offset, _opt(e["index"], int))
        transforms = None if e["transforms"] is None else _list_of(e["transforms"], str)
        where = (_file_name(e["path"]), _typed(e["byte_offset"], int), _typed(e["length"], int))
        storage[index] = _StorageInfo(*where, transforms)
    planner_data = obj["planner_data"]
    if planner_data is not None:  # flattened key -> its path of dict keys and list indices
        planner_data = {_typed(k, str): tuple(_list_of(v, str, int)) for k, v in planner_data.items()}
    sm = obj["storage_meta"]
    meta = StorageMeta(
        checkpoint_id=_opt(sm["checkpoint_id"], str),
        save_id=_opt(sm["save_id"], str),
        modules=_list_of(sm["modules"], str),
    )
    return Metadata(items, planner_data, storage, meta, _opt(obj["version"], str))
