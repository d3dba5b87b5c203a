"""Nested state containers walked in one place: what a container is, how it is rebuilt, its paths.

A container is a ``dict`` (any subclass, rebuilt as a plain dict in the same key order), a ``list``
(rebuilt as a list) or a ``tuple`` that is not a namedtuple (rebuilt as a tuple). Everything else
is a leaf, namedtuples included: their constructors take fields, not an iterable, so they are kept
whole rather than rebuilt wrongly. A leaf's path is ``/`` joined with each key or index on the way
down (``/optim/state/0/exp_avg``): snapshot buffers, checkpoint tensors and error messages are
named by it, so its spelling is part of the saved format.

The walks run on the training step's hot path (every snapshot copies each tensor leaf through
one), so they are written for speed: one closure each, the path built only where asked for, and
``leaf_types`` (e.g. ``torch.Tensor``, most of a state's leaves) handed to the leaf function
straight from the parent's loop, which makes a walk as fast as one written by hand
(``benchmarks/state_walks.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

LeafFn = Callable[[Any], Any]
PathLeafFn = Callable[[Any, str], Any]
Stop = Callable[[Any], bool]
# (the original container, its rebuilt self with mapped children, its path) -> what stands for it
Wrap = Callable[[Any, Any, str], Any]
LeafTypes = type | tuple[type, ...]


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def map_leaves(fn: LeafFn, tree: Any, *, leaf_types: LeafTypes = (), stop: Stop | None = None) -> Any:
    """``tree`` rebuilt with each leaf replaced by ``fn(leaf)``.

    ``leaf_types``: types that are never containers, passed to ``fn`` without a container test (a
    speed hint only). ``stop(node)`` True makes that node a leaf, handed whole to ``fn`` (e.g. a
    dict that stands for one value).
    """
    lt = leaf_types

    def walk(obj: Any) -> Any:
        if stop is not None and stop(obj):
            return fn(obj)
        if isinstance(obj, dict):
            return {k: fn(v) if isinstance(v, lt) else walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [fn(v) if isinstance(v, lt) else walk(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple([fn(v) if isinstance(v, lt) else walk(v) for v in obj])
        return fn(obj)

    return fn(tree) if isinstance(tree, lt) else walk(tree)


def map_with_path(
    fn: PathLeafFn,
    tree: Any,
    path: str = "",
    *,
    leaf_types: LeafTypes = (),
    stop: Stop | None = None,
    wrap: Wrap | None = None,
) -> Any:
    """``tree`` rebuilt with each leaf replaced by ``fn(leaf, its path)``, paths under ``path``.

    ``leaf_types`` and ``stop`` as in :func:`map_leaves`. ``wrap`` turns each rebuilt container
    into what stands for it (the checkpoint codec tags them), once its children are mapped.
    """
    lt = leaf_types

    def walk(obj: Any, path: str) -> Any:
        if stop is not None and stop(obj):
            return fn(obj, path)
        out: Any
        if isinstance(obj, dict):
            out = {
                k: fn(v, f"{path}/{k}") if isinstance(v, lt) else walk(v, f"{path}/{k}")
                for k, v in obj.items()
            }
        elif isinstance(obj, list):
            out = [
                fn(v, f"{path}/{i}") if isinstance(v, lt) else walk(v, f"{path}/{i}")
                for i, v in enumerate(obj)
            ]
        elif isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            out = tuple(
                [
                    fn(v, f"{path}/{i}") if isinstance(v, lt) else walk(v, f"{path}/{i}")
                    for i, v in enumerate(obj)
                ]
            )
        else:
            return fn(obj, path)
        return out if wrap is None else wrap(obj, out, path)

    return fn(tree, path) if isinstance(tree, lt) else walk(tree, path)


def any_leaf(
    pred: Callable[[Any], bool], tree: Any, *, leaf_types: LeafTypes = (), stop: Stop | None = None
) -> bool:
    """Whether ``pred`` holds for some leaf of ``tree`` (``leaf_types`` and ``stop`` as in
    :func:`map_leaves`), looking no further than the first one that does."""
    lt = leaf_types

    def walk(obj: Any) -> bool:
        if stop is not None and stop(obj):
            return pred(obj)
        if isinstance(obj, dict):
            children: Any = obj.values()
        elif isinstance(obj, list) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
            children = obj
        else:
            return pred(obj)
        return any(pred(v) if isinstance(v, lt) else walk(v) for v in children)

    return pred(tree) if isinstance(tree, lt) else walk(tree)
