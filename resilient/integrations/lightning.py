"""PyTorch Lightning: a ``Trainer`` whose ``fit`` survives faults, in one line.

.. code-block:: python

    from resilient.integrations.lightning import ResilientDDPStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=ResilientDDPStrategy(), deterministic=True)
    trainer.fit(model, datamodule)  # run with `resilient launch --nproc-per-node 2 train.py` (or torchrun)

``ResilientDDPStrategy`` is Lightning's ``DDPStrategy`` (every argument it takes) plus the runtime's
configuration (``config=`` a file or a :class:`resilient.Config`, and any of its keys:
``hang_timeout=30``, ``checkpoint={"dir": "ckpt"}``). ``fit`` runs inside ``resilient.wrap``: on a
soft fault every rank re-enters it in its own process and resumes at the last good step, with the
model, optimizers, schedulers, Lightning's loops, the train dataloader's position, callbacks,
precision plugin and RNGs as they were; under ``resilient launch`` a killed rank is replaced and
resumes the same way. With ``deterministic=True`` and ``seed_everything`` the run ends bit for bit
where a fault-free run ends. ``validate``, ``test`` and ``predict`` run as under ``DDPStrategy``.

Both ``import lightning.pytorch as pl`` and ``import pytorch_lightning as pl`` work: the strategy is
built for the package the script imported (``lightning="pytorch_lightning"`` says which when a
process imports both). Lightning is imported by this module only (``import resilient`` does not).
The design and its limits: docs/lightning.md.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from resilient.integrations._lightning_strategy import BUILT, LightningSetupError, strategy_class

__all__ = ["LightningSetupError", "ResilientDDPStrategy", "lightning_package"]

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def lightning_package(name: str | None = None) -> ModuleType:
    """The Lightning package a strategy is built for: ``name``, else the one this process imported,
    else whichever is installed (``lightning.pytorch`` first)."""
    if name is not None:
        if name not in _PACKAGES:
            raise LightningSetupError(
                f"ResilientDDPStrategy(lightning={name!r}): one of {', '.join(_PACKAGES)}"
            )
        return _import(name)
    imported = [p for p in _PACKAGES if p in sys.modules]
    if len(imported) == 2:
        raise LightningSetupError(
            "both lightning.pytorch and pytorch_lightning are imported: say which Trainer the strategy "
            "is for, ResilientDDPStrategy(lightning='lightning.pytorch') or (lightning='pytorch_lightning')"
        )
    for p in imported or _PACKAGES:
        try:
            return _import(p)
        except LightningSetupError:
            continue
    raise LightningSetupError(
        "PyTorch Lightning is not installed: pip install 'resilient[lightning]' (or lightning>=2.1)"
    )


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise LightningSetupError(f"cannot import {name}: {e}") from e


class _EitherPackage(type):
    """``isinstance(s, ResilientDDPStrategy)`` holds for the strategy of either package."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, tuple(BUILT))

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, tuple(BUILT))


class ResilientDDPStrategy(metaclass=_EitherPackage):
    """Lightning's ``DDPStrategy`` whose ``fit`` survives faults (see the module docstring).

    ``ResilientDDPStrategy(config=None, checks=(), hooks=(), lightning=None, **kwargs)``: ``config``,
    ``checks`` and ``hooks`` as :func:`resilient.wrap` takes them; a keyword that is a key of
    :class:`resilient.Config` (``hang_timeout``, ``checkpoint``, ``snapshot``, ...) overrides the
    configuration; every other keyword goes to ``DDPStrategy`` (``find_unused_parameters=True``,
    ``static_graph=True``, ...). The instance is a subclass of the imported package's
    ``DDPStrategy``, and ``isinstance(s, ResilientDDPStrategy)`` holds."""

    def __new__(cls, *args: Any, lightning: str | None = None, **kwargs: Any) -> Any:
        return strategy_class(lightning_package(lightning))(*args, **kwargs)
