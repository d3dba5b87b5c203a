"""The configuration reference (``docs/configuration.md``), generated from :mod:`resilient.config`.

``python -m resilient.config_reference > docs/configuration.md`` regenerates it; a unit test
(``tests/unit/test_docs.py``) fails when the file and the models disagree. Every field of
:class:`~resilient.config.Config` becomes a table row (its YAML key with the dotted path, type,
default, and the field's ``description``); every nested model becomes a section, introduced by its
docstring.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from resilient.config import Config, Timeouts

COMMAND = "python -m resilient.config_reference > docs/configuration.md"

_HEADER = f"""\
# Configuration reference

<!-- Generated: do not edit by hand. Regenerate with `{COMMAND}`. -->

Generated from the pydantic models in [`resilient/config.py`](../resilient/config.py) (each
field's `description`, each section's docstring) by `{COMMAND}`;
`tests/unit/test_docs.py` fails when this file and the models disagree. The defaults are
mirrored, with comments, in [`configs/default.yaml`](../configs/default.yaml).

Pass a YAML path and/or keyword overrides: `@resilient.wrap(config="my.yaml", hang_timeout=30,
restart={{"max_recoveries": 5}})` (nested mappings merge). A bad value fails at decoration time,
naming the field, the value and the file: `my.yaml: hang_timeout = -5: Input should be greater
than 0`; an unknown key is an error too. `resilient config my.yaml --set hang_timeout=30`
validates a file and prints it with the timeouts derived from it.
"""

_DERIVED = """\
## Derived timeouts

Derived from `hang_timeout` and `collective_timeout`, never set by hand, so they cannot be
mis-ordered (`Timeouts.derive`; hang < hard < barrier). The last column is computed with the
defaults above.

| timeout | derived as | seconds at the defaults |
|---|---|---|
{rows}
"""

# Timeouts field → (what it is, how it is derived); a field missing here still gets a row.
_TIMEOUTS = {
    "hang": ("hang: no completed step this long", "`hang_timeout`"),
    "collective": ("per-collective timeout of the group", "`collective_timeout`, else `2 × hang_timeout`"),
    "startup": ("the first step of each generation (start-up)", "`5 × hang_timeout`"),
    "hard": ("the GIL-hang backstop (SIGALRM)", "`hang_timeout + max(2 s, hang_timeout / 2)`"),
    "barrier": ("restart barriers", "`max(collective, startup + max(2 s, hang_timeout / 2)) + 10 s`"),
    "monitor_interval": ("the monitor's poll interval", "`min(50 ms, hang_timeout / 40)`"),
    "peer_report": (
        "a step check waiting on a peer's count longer than this reports what it waits for (`peer_wait`)",
        "`min(1 s, hang_timeout / 4)`",
    ),
    "victim_grace": (
        "a rank blocked in a collective waits this much past the hang limit, so the hanging peer is named",
        "`min(1 s, hang_timeout / 4)`",
    ),
}

_OPS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))


def _code(text: str) -> str:
    return f"`{text}`"


def _cell(text: str) -> str:
    """One table cell: a single line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _number(v: float) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else repr(v)


def _yaml(value: Any) -> str:
    """A default as it would be written in YAML (flow style)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return _number(value)
    if isinstance(value, enum.Enum):
        return _yaml(value.value)
    if isinstance(value, str | PurePath):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _type(annotation: Any) -> str:
    """A field's type in words: `int or `auto``, `list of str`, `path or null`."""
    if annotation is None or annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " or ".join(_code(_yaml(a)) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_type(a) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        return " or ".join(parts)
    if origin in (tuple, list, set, frozenset):
        inner = [a for a in args if a is not Ellipsis]
        return "list of " + _type(inner[0]) if len(set(inner)) == 1 else "list"
    if origin is dict or annotation is dict:
        return "mapping"
    if isinstance(annotation, type):
        if issubclass(annotation, PurePath):
            return "path"
        if issubclass(annotation, bool):
            return "bool"
        return annotation.__name__
    return str(annotation)


def _constraints(info: FieldInfo) -> str:
    out = []
    for meta in info.metadata:
        for attr, sign in _OPS:
            bound = getattr(meta, attr, None)
            if bound is not None:
                out.append(f"{sign} {_number(bound)}")
    return ", ".join(out)


def _default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]
    return info.default


def _doc(model: type[BaseModel]) -> str:
    """A model's docstring as markdown (reST ``literals`` become `code`)."""
    return inspect.cleandoc(model.__doc__ or "").replace("``", "`")


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _sections(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel], list[str]]]:
    """(dotted prefix, model, table rows) for ``model`` and then each nested model, depth first."""
    rows = []
    nested = []
    for name, info in model.model_fields.items():
        key = prefix + name
        sub = _submodel(info.annotation)
        if sub is not None:
            nested.append((key, sub))
            continue
        kind = _type(info.annotation)
        limits = _constraints(info)
        if limits:
            kind += f", {limits}"
        row = [_code(key), kind, _code(_yaml(_default(info))), info.description or ""]
        rows.append("| " + " | ".join(_cell(c) for c in row) + " |")
    yield prefix.rstrip("."), model, rows
    for key, sub in nested:
        yield from _sections(sub, key + ".")


def undocumented() -> list[str]:
    """Dotted keys of the fields that have no ``description`` (their row's description is empty)."""
    missing = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            sub = _submodel(info.annotation)
            if sub is not None:
                walk(sub, prefix + name + ".")
            elif not info.description:
                missing.append(prefix + name)

    walk(Config, "")
    return missing


def markdown() -> str:
    """The whole reference, as ``docs/configuration.md`` holds it."""
    parts = [_HEADER]
    for prefix, model, rows in _sections(Config):
        title = "Top level" if not prefix else f"`{prefix}`"
        body = [f"## {title}", ""]
        doc = _doc(model)
        if doc:
            body += [doc, ""]
        if rows:
            body += ["| key | type | default | description |", "|---|---|---|---|", *rows, ""]
        parts.append("\n".join(body))
    t = Timeouts.derive(Config().hang_timeout, Config().collective_timeout)
    rows = []
    for f in dataclasses.fields(t):
        label, formula = _TIMEOUTS.get(f.name, (f.name, ""))
        rows.append(f"| {label} | {formula} | {_number(getattr(t, f.name))} |")
    parts.append(_DERIVED.format(rows="\n".join(rows)))
    return "\n".join(parts)


def main() -> int:
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
