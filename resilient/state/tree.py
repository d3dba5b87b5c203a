"""Nested state containers walked in one place: what a container is, how it is rebuilt, its paths.

A container is a ``dict`` (any subclass, rebuilt as a plain dict in the same key order), a ``list``
(rebuilt as a list) or a ``tuple`` that is not a namedtuple (rebuilt as a tuple). Everything else
is a leaf, namedtuples included: their constructors take fields, not an iterable, so they are kept
whole rather than rebuilt wrongly. A leaf's path is ``/`` joined with each key or index on the way
down (``/optim/state/0/exp_avg``): snapshot buffers, checkpoint tensors and error messages are
named by it, so its spelling is part of the saved format.

The walks run on the training step's hot path (every snapshot copies each tensor leaf through
one), so they are written for speed: one closure each, the path built only where asked for, and
``typed=(torch.Tensor, copy)`` sends the leaves most of a state is made of to their own function
straight from the parent's loop, tested once (``benchmarks/state_walks.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LeafFn = Callable[[Any], Any]
PathLeafFn = Callable[[Any, str], Any]
Stop = Callable[[Any], bool]
# (the original container, its rebuilt self with mapped children, its path) -> what stands for it
Wrap = Callable[[Any, Any, str], Any]
Types = type | tuple[type, ...]


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def map_leaves(
    fn: LeafFn, tree: Any, *, typed: tuple[Types, LeafFn] | None = None, stop: Stop | None = None
) -> Any:
    """``tree`` rebuilt with each leaf replaced by ``fn(leaf)``.

    ``typed=(types, typed_fn)``: leaves of those types (never containers) go to ``typed_fn``
    instead, straight from their parent's loop, so neither the walk nor ``fn`` tests them: the
    fast path for a state's tensors. ``stop(node)`` True makes that node a leaf, handed whole to
    ``fn`` (e.g. a dict that stands for one value).
    """
    lt, tfn = typed if typed is not None else ((), fn)

    def walk(obj: Any) -> Any:
        if stop is not None and stop(obj):
            return fn(obj)
        if isinstance(obj, dict):
            return {k: tfn(v) if isinstance(v, lt) else walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [tfn(v) if isinstance(v, lt) else walk(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple([tfn(v) if isinstance(v, lt) else walk(v) for v in obj])
        return fn(obj)

    return tfn(tree) if isinstance(tree, lt) else walk(tree)


def map_with_path(
    fn: PathLeafFn,
    tree: Any,
    path: str = "",
    *,
    typed: tuple[Types, PathLeafFn] | None = None,
    stop: Stop | None = None,
    wrap: Wrap | None = None,
) -> Any:
    """``tree`` rebuilt with each leaf replaced by ``fn(leaf, its path)``, paths under ``path``.

    ``typed`` and ``stop`` as in :func:`map_leaves`. ``wrap`` turns each rebuilt container into
    what stands for it (the checkpoint codec tags them), once its children are mapped.
    """
    lt, tfn = typed if typed is not None else ((), fn)

    def walk(obj: Any, path: str) -> Any:
        if stop is not None and stop(obj):
            return fn(obj, path)
        out: Any
        if isinstance(obj, dict):
            out = {
                k: tfn(v, f"{path}/{k}") if isinstance(v, lt) else walk(v, f"{path}/{k}")
                for k, v in obj.items()
            }
        elif isinstance(obj, list):
            out = [
                tfn(v, f"{path}/{i}") if isinstance(v, lt) else walk(v, f"{path}/{i}")
                for i, v in enumerate(obj)
            ]
        elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            out = tuple(
                [
                    tfn(v, f"{path}/{i}") if isinstance(v, lt) else walk(v, f"{path}/{i}")
                    for i, v in enumerate(obj)
                ]
            )
        else:
            return fn(obj, path)
        return out if wrap is None else wrap(obj, out, path)

    return tfn(tree, path) if isinstance(tree, lt) else walk(tree, path)


def any_leaf(
    pred: Callable[[Any], bool],
    tree: Any,
    *,
    typed: tuple[Types, Callable[[Any], bool]] | None = None,
    stop: Stop | None = None,
) -> bool:
    """Whether ``pred`` holds for some leaf of ``tree`` (``typed`` and ``stop`` as in
    :func:`map_leaves`), looking no further than the first one that does."""
    lt, tpred = typed if typed is not None else ((), pred)

    def walk(obj: Any) -> bool:
        if stop is not None and stop(obj):
            return pred(obj)
        if isinstance(obj, dict):
            children: Any = obj.values()
        elif isinstance(obj, list) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
            children = obj
        else:
            return pred(obj)
        return any(tpred(v) if isinstance(v, lt) else walk(v) for v in children)

    return tpred(tree) if isinstance(tree, lt) else walk(tree)
