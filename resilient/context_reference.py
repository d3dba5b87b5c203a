"""The API reference of what a training function meets (``docs/context.md``), generated from the code.

``python -m resilient.context_reference > docs/context.md`` regenerates it; a unit test
(``tests/unit/test_docs.py``) fails when the file and the code disagree, or when a public member of
:class:`~resilient.runtime.context.Context` has no docstring. ``resilient.wrap`` and
``resilient.current`` come first, then every public member of ``Context`` in the order the class
defines them, each with its signature and its docstring.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from resilient.runtime.context import Context
from resilient.runtime.wrapper import current, wrap

COMMAND = "python -m resilient.context_reference > docs/context.md"

_HEADER = f"""\
# `resilient.wrap` and the `Context` reference

<!-- Generated: do not edit by hand. Regenerate with `{COMMAND}`. -->

Generated from the docstrings in [`resilient/runtime/wrapper.py`](../resilient/runtime/wrapper.py)
and [`resilient/runtime/context.py`](../resilient/runtime/context.py) by `{COMMAND}`;
`tests/unit/test_docs.py` fails when this file and the code disagree. The configuration keys
`wrap` accepts are in [configuration.md](configuration.md); what happens at a fault, in
[recovery.md](recovery.md).

```python
import resilient

@resilient.wrap()
def train(ctx: resilient.Context):  # a parameter named ctx receives the Context
    print(ctx.rank, ctx.world_size, ctx.device)
    ...
```
"""


def _doc(obj: Any) -> str:
    """The docstring as markdown: dedented, reST literals as code, ``::`` blocks fenced."""
    text = inspect.cleandoc(inspect.getdoc(obj) or "")
    role = re.compile(r":(?:class|func|mod|meth|attr):`~?([^`]+)`")
    text = role.sub(lambda m: f"`{m.group(1).split('.')[-1]}`", text)
    text = text.replace("``", "`")
    out: list[str] = []
    block = False
    for line in text.splitlines():
        if block and line and not line.startswith("    "):
            out.append("```")
            block = False
        if block:
            if line or out[-1] != "```python":  # (not the blank line that follows the ``::``)
                out.append(line[4:])
            continue
        if line.rstrip().endswith("::"):
            out.append(line.rstrip()[:-1])
            out.append("")
            out.append("```python")
            block = True
            continue
        out.append(line)
    while block and out and not out[-1].strip():
        out.pop()
    if block:
        out.append("```")
    return "\n".join(out).strip()


def _annotation(a: Any) -> str:
    return a if isinstance(a, str) else inspect.formatannotation(a)  # (strings: postponed annotations)


def _signature(fn: Callable[..., Any], name: str, *, skip_self: bool) -> str:
    sig = inspect.signature(fn)
    shown: list[str] = []
    for p in list(sig.parameters.values())[1 if skip_self else 0 :]:
        text = ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        if p.kind is p.KEYWORD_ONLY and not any(s.startswith("*") for s in shown):
            shown.append("*")
        shown.append(text)
    ret = sig.return_annotation
    ret_s = "" if ret is sig.empty else f" -> {_annotation(ret)}"
    return f"{name}({', '.join(shown)}){ret_s}"


def members() -> Iterator[tuple[str, Any]]:
    """The public members of ``Context``, in the order the class defines them."""
    for name, value in vars(Context).items():
        if not name.startswith("_"):
            yield name, value


def undocumented() -> list[str]:
    """Public members of ``Context`` without a docstring (each must say what it is)."""
    out = []
    for name, value in members():
        target = value.fget if isinstance(value, property) else value
        if not inspect.getdoc(target):
            out.append(name)
    return out


def markdown() -> str:
    parts = [_HEADER]
    parts.append("## `resilient.wrap`\n")
    parts.append(f"```python\n{_signature(wrap, 'resilient.wrap', skip_self=False)}\n```\n")
    parts.append(_doc(wrap) + "\n")
    parts.append("## `resilient.current`\n")
    parts.append(f"```python\n{_signature(current, 'resilient.current', skip_self=False)}\n```\n")
    parts.append(_doc(current) + "\n")
    parts.append("## `Context`\n")
    parts.append(_doc(Context) + "\n")
    props = [(n, v) for n, v in members() if isinstance(v, property)]
    methods = [(n, v) for n, v in members() if not isinstance(v, property)]
    parts.append("### Properties (read-only)\n")
    parts.append("| property | type | what it is |\n|---|---|---|")
    for name, prop in props:
        assert prop.fget is not None
        kind = _annotation(inspect.signature(prop.fget).return_annotation).replace("|", "\\|")
        doc = " ".join(_doc(prop.fget).split()).replace("|", "\\|")
        parts.append(f"| `ctx.{name}` | `{kind}` | {doc} |")
    parts.append("")
    parts.append("### Methods\n")
    for name, fn in methods:
        parts.append(f"#### `ctx.{name}`\n")
        parts.append(f"```python\n{_signature(fn, 'ctx.' + name, skip_self=True)}\n```\n")
        parts.append(_doc(fn) + "\n")
    return "\n".join(parts).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
