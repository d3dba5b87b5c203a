"""What ``self.log`` has accumulated in the epoch a snapshot is taken in, kept with it.

Lightning aggregates a value logged with ``on_epoch=True`` over the epoch's batches (a mean
weighted by the batch size, a sum, a min, a max) in the training loop's result collection, and a
``torchmetrics.Metric`` accumulates its own state (non-persistent buffers: in no ``state_dict``).
Neither is in Lightning's checkpoint: resumed mid-epoch, the epoch's aggregate would cover only
the batches after the restore, and a callback monitoring it (``EarlyStopping``,
``ModelCheckpoint``, ``ReduceLROnPlateau`` on a training metric) could decide otherwise than in the
fault-free run. Here each is captured as plain values and tensors (what a snapshot can hold) and
rebuilt in the new entry's collection.
"""

from __future__ import annotations

from typing import Any

import torch

_REDUCE = {"mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min}
_META = (
    "fx",
    "name",
    "prog_bar",
    "logger",
    "on_step",
    "on_epoch",
    "enable_graph",
    "add_dataloader_idx",
    "dataloader_idx",
    "metric_attribute",
)


def _reduce_name(meta: Any) -> str | None:
    for name, fn in _REDUCE.items():
        if meta.reduce_fx is fn or getattr(meta, f"is_{name}_reduction", False):
            return name
    return None


def capture_results(results: Any) -> list[dict[str, Any]]:
    """The training loop's logged tensors, with what ``self.log`` was told about each (values
    that are ``torchmetrics`` objects keep their state in the module: :func:`capture_metrics`)."""
    out = []
    for key, m in results.items():
        reduce = _reduce_name(m.meta)
        if not m.is_tensor or reduce is None:
            continue
        sync = m.meta.sync
        out.append(
            {
                "key": key,
                "meta": {k: getattr(m.meta, k) for k in _META},
                "reduce": reduce,
                "sync": bool(sync.should),
                "rank_zero_only": bool(sync.rank_zero_only),
                "state": {name: getattr(m, name) for name in m._defaults},
                "update_count": int(m._update_count),
                "has_reset": bool(m.has_reset),
                "forward_cache": m._forward_cache,
            }
        )
    return out


def restore_results(results: Any, captured: list[dict[str, Any]], pl: Any, reduce_fn: Any) -> None:
    """Rebuild each captured value in ``results`` (a fresh loop's collection); ``reduce_fn``: the
    strategy's ``reduce``, which ``self.log`` names as its sync function (a rebuilt value must
    equal the one the next ``self.log`` builds, or Lightning refuses it as logged twice)."""
    result = pl.trainer.connectors.logger_connector.result
    for c in captured:
        meta = result._Metadata(**c["meta"], reduce_fx=_REDUCE[c["reduce"]])
        meta.sync = result._Sync(_should=c["sync"], fn=reduce_fn, rank_zero_only=c["rank_zero_only"])
        m = result._ResultMetric(meta, True)
        for name, value in c["state"].items():
            setattr(m, name, value.clone())
        m._update_count = c["update_count"]
        m.has_reset = c["has_reset"]
        cache = c["forward_cache"]
        m._forward_cache = cache.clone() if isinstance(cache, torch.Tensor) else cache
        results[c["key"]] = m


def _metrics(module: Any) -> list[tuple[str, Any]]:
    try:
        from torchmetrics import Metric
    except ImportError:  # (Lightning without torchmetrics: no metric objects to keep)
        return []
    return [(name, m) for name, m in module.named_modules() if isinstance(m, Metric)]


def capture_metrics(module: Any) -> dict[str, Any]:
    """Every ``torchmetrics.Metric`` of the module: its accumulated state and update count."""
    out: dict[str, Any] = {}
    for name, m in _metrics(module):
        out[name] = {"state": dict(m.metric_state), "update_count": int(m._update_count)}
    return out


def restore_metrics(module: Any, captured: dict[str, Any]) -> None:
    for name, m in _metrics(module):
        c = captured.get(name)
        if c is None:
            continue
        for attr, value in c["state"].items():
            setattr(m, attr, [v.clone() for v in value] if isinstance(value, list) else value.clone())
        m._update_count = c["update_count"]
        m._computed = None
