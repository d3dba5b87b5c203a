"""Which locals a training loop carries from one step to the next by rebinding them.

A name is carried when an iteration of the loop over ``ctx.steps(...)`` (or ``ctx.epochs(...)``)
can read it before it is definitely assigned in that same iteration, and the loop assigns it
somewhere: ``iter_num += 1``, a batch prefetched at a step's end, ``best = min(best, loss)``. Such
a value comes from the previous step, and after a fault the function's top computes it afresh.

The analysis is a forward "definitely assigned" pass over the loop body's AST, conservative
where control flow forks: an ``if`` assigns what all its branches assign, a loop may run zero
times, a ``try`` body may stop anywhere, and nested scopes (lambdas, comprehensions, ``def``) read
their free names where they are defined. Pure: source text in, names out.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

# What is definitely assigned at a point; None: the point is unreachable (after return/continue).
Defined = frozenset[str] | None
LOOP_CALLS = frozenset({"steps", "epochs"})
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


@dataclass(frozen=True)
class LoopNames:
    """The names of the step loop (and of an epoch loop's inner step loop) a scan needs."""

    carried: frozenset[str]  # read before definitely assigned in an iteration, assigned in the loop
    # carried even when every inner loop runs at least once: a value a step surely hands to the
    # next (``loss`` read after the gradient-accumulation loop that assigns it is not)
    steady: frozenset[str]
    assigned: frozenset[str]  # bound in the innermost step loop's body (its temporaries among them)
    targets: frozenset[str]  # the loop targets (``step``, ``x, y``): bound afresh every iteration
    declared: frozenset[str]  # ``global``/``nonlocal`` names of the function: not its locals


def step_loop_names(source: str, line: int | None = None) -> LoopNames | None:
    """The names of the step loop in ``source`` (one function, or a module); ``line`` (1-based, in
    ``source``) picks the loop the frame runs when there are several. None: no step loop."""
    tree = ast.parse(textwrap.dedent(source))
    top: Sequence[ast.stmt] = tree.body
    if len(top) == 1 and isinstance(top[0], ast.FunctionDef | ast.AsyncFunctionDef):
        top = top[0].body
    chain = _chain(top, line)
    if not chain:
        return None
    declared = frozenset(_declared(top))
    carried: set[str] = set()
    steady: set[str] = set()
    targets: set[str] = set()
    assigned: frozenset[str] = frozenset()
    for loop in chain:
        targets |= _names(loop.target)
        flow, ran = _run(loop, _Flow()), _run(loop, _Flow(loops_run=True))
        carried |= flow.exposed & flow.assigned
        steady |= ran.exposed & ran.assigned
        assigned = frozenset(flow.assigned)
    return LoopNames(
        carried=frozenset(carried - targets - declared),
        steady=frozenset(steady - targets - declared),
        assigned=assigned - declared,
        targets=frozenset(targets),
        declared=declared,
    )


def _run(loop: ast.For | ast.AsyncFor, flow: _Flow) -> _Flow:
    """``flow`` over one iteration of ``loop``: its targets bound, then its body."""
    flow.block(loop.body, flow.target(loop.target, frozenset()))
    return flow


def _is_step_loop(node: ast.AST, line: int | None) -> bool:
    """A ``for`` over ``<anything>.steps(...)``/``.epochs(...)``, or the ``for`` at ``line`` (the
    frame is iterating it: ``for step in steps`` over a generator kept in a local)."""
    if not isinstance(node, ast.For | ast.AsyncFor):
        return False
    if node.lineno == line:
        return True
    func = node.iter.func if isinstance(node.iter, ast.Call) else None
    return isinstance(func, ast.Attribute) and func.attr in LOOP_CALLS


def _blocks(stmt: ast.stmt) -> Iterator[list[ast.stmt]]:
    """The statement lists nested in ``stmt`` that run in the same scope."""
    if isinstance(stmt, _SCOPES):
        return
    for field in ("body", "orelse", "finalbody"):
        block = getattr(stmt, field, None)
        if isinstance(block, list):
            yield block
    for part in (*getattr(stmt, "handlers", ()), *getattr(stmt, "cases", ())):
        yield part.body


def _step_loops(stmts: Iterable[ast.stmt], line: int | None) -> Iterator[ast.For | ast.AsyncFor]:
    """The outermost step loops among ``stmts`` (not those nested in another step loop)."""
    for stmt in stmts:
        if isinstance(stmt, ast.For | ast.AsyncFor) and _is_step_loop(stmt, line):
            yield stmt
        else:
            for block in _blocks(stmt):
                yield from _step_loops(block, line)


def _contains(node: ast.stmt, line: int | None) -> bool:
    return line is None or node.lineno <= line <= (node.end_lineno or node.lineno)


def _chain(stmts: Sequence[ast.stmt], line: int | None) -> list[ast.For | ast.AsyncFor]:
    """The step loops from the outermost that holds ``line`` down to the innermost."""
    loops = list(_step_loops(stmts, line))
    chosen = next((lp for lp in loops if _contains(lp, line)), None)
    if chosen is None:
        if not loops:
            return []
        chosen, line = loops[0], None  # the line is not in a step loop: the first one, whole
    inner = _chain(chosen.body, line)
    return [chosen, *inner]


def _declared(stmts: Iterable[ast.stmt]) -> Iterator[str]:
    for stmt in stmts:
        if isinstance(stmt, ast.Global | ast.Nonlocal):
            yield from stmt.names
        for block in _blocks(stmt):
            yield from _declared(block)


def _names(target: ast.AST) -> frozenset[str]:
    """The names a target binds (``x``, ``x, (y, *z)``); attributes and subscripts bind none."""
    if isinstance(target, ast.Name):
        return frozenset({target.id})
    if isinstance(target, ast.Tuple | ast.List):
        return frozenset().union(*(_names(e) for e in target.elts))
    if isinstance(target, ast.Starred):
        return _names(target.value)
    return frozenset()


def _meet(*paths: Defined) -> Defined:
    """What is assigned on every path that reaches the join (unreachable paths do not count)."""
    live = [p for p in paths if p is not None]
    return frozenset.intersection(*live) if live else None


def _has_break(stmts: Iterable[ast.stmt]) -> bool:
    for stmt in stmts:
        if isinstance(stmt, ast.Break):
            return True
        if not isinstance(stmt, ast.For | ast.AsyncFor | ast.While) and any(
            _has_break(b) for b in _blocks(stmt)
        ):
            return True
    return False


def _free_names(scope: ast.AST) -> tuple[set[str], set[str]]:
    """The names a nested scope reads from its enclosing one, and those it may bind there (a
    ``nonlocal`` name, which it reads too; a walrus target in a comprehension)."""
    bound: set[str] = set()
    loads: set[str] = set()
    nonlocal_: set[str] = set()
    walrus: set[str] = set()
    if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        a = scope.args
        bound |= {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x}
        body: list[ast.AST] = list(scope.body) if isinstance(scope.body, list) else [scope.body]
    elif isinstance(scope, _COMPREHENSIONS):
        body = list(scope.generators)
        body += [scope.key, scope.value] if isinstance(scope, ast.DictComp) else [scope.elt]
    else:
        body = list(getattr(scope, "body", []))
    for node in _walk_scope(body):
        if isinstance(node, ast.Nonlocal):
            nonlocal_ |= set(node.names)
        elif isinstance(node, ast.Global):
            bound |= set(node.names)
        elif isinstance(node, ast.NamedExpr) and isinstance(scope, _COMPREHENSIONS):
            walrus |= _names(node.target)
        elif isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        if isinstance(node, (*_SCOPES, *_COMPREHENSIONS)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound.add(node.name)
            inner_reads, inner_writes = _free_names(node)
            loads |= inner_reads | _definition_reads(node)
            walrus |= inner_writes
    bound -= nonlocal_ | walrus
    return (loads - bound) | nonlocal_, nonlocal_ | walrus


def _definition_reads(node: ast.AST) -> set[str]:
    """What a nested definition reads where it is defined: decorators, defaults, base classes."""
    parts: list[ast.AST] = list(getattr(node, "decorator_list", []))
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        parts += [*node.args.defaults, *(x for x in node.args.kw_defaults if x is not None)]
    if isinstance(node, ast.ClassDef):
        parts += [*node.bases, *(k.value for k in node.keywords)]
    return {n.id for part in parts for n in ast.walk(part) if isinstance(n, ast.Name)}


def _walk_scope(nodes: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Every node of one scope, and each nested scope's node itself (not its insides)."""
    for node in nodes:
        yield node
        if not isinstance(node, (*_SCOPES, *_COMPREHENSIONS)):
            yield from _walk_scope(ast.iter_child_nodes(node))


class _Flow:
    """One pass over a loop body: the names read where they may be unassigned, and all bound.
    ``loops_run``: take every inner loop's body to run at least once (see :class:`LoopNames`)."""

    def __init__(self, loops_run: bool = False) -> None:
        self.loops_run = loops_run
        self.exposed: set[str] = set()
        self.assigned: set[str] = set()

    def read(self, name: str, d: Defined) -> None:
        if d is not None and name not in d:
            self.exposed.add(name)

    def bind(self, names: Iterable[str], d: Defined) -> Defined:
        names = set(names)
        self.assigned |= names
        return None if d is None else d | names

    def nested(self, scope: ast.AST, d: Defined) -> None:
        reads, writes = _free_names(scope)
        for name in reads:
            self.read(name, d)
        self.assigned |= writes  # maybe assigned (when called): never definitely

    def target(self, node: ast.AST, d: Defined) -> Defined:
        if isinstance(node, ast.Name):
            return self.bind([node.id], d)
        if isinstance(node, ast.Tuple | ast.List):
            for elt in node.elts:
                d = self.target(elt, d)
            return d
        if isinstance(node, ast.Starred):
            return self.target(node.value, d)
        return self.expr(node, d)  # obj.attr = ... / a[i] = ...: reads obj, a and i

    def expr(self, node: ast.AST | None, d: Defined) -> Defined:
        if node is None:
            return d
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                self.read(node.id, d)
                return d
            return self.bind([node.id], d) if isinstance(node.ctx, ast.Store) else d
        if isinstance(node, ast.NamedExpr):
            return self.bind(_names(node.target), self.expr(node.value, d))
        if isinstance(node, ast.BoolOp):
            first = self.expr(node.values[0], d)
            later = first
            for value in node.values[1:]:  # evaluated only sometimes: nothing they bind is definite
                later = self.expr(value, later)
            return first
        if isinstance(node, ast.IfExp):
            d = self.expr(node.test, d)
            return _meet(self.expr(node.body, d), self.expr(node.orelse, d))
        if isinstance(node, _COMPREHENSIONS):
            d = self.expr(node.generators[0].iter, d)  # the first iterable runs in this scope
            self.nested(node, d)
            return d
        if isinstance(node, ast.Lambda):
            d = self._defaults(node.args, d)
            self.nested(node, d)
            return d
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                d = self.expr(child, d)
            elif isinstance(child, ast.keyword):
                d = self.expr(child.value, d)
        return d

    def _defaults(self, args: ast.arguments, d: Defined) -> Defined:
        for default in (*args.defaults, *args.kw_defaults):
            d = self.expr(default, d)
        return d

    def block(self, stmts: Sequence[ast.stmt], d: Defined) -> Defined:
        for stmt in stmts:
            if d is None:
                return None  # the rest of the block is unreachable
            d = self.stmt(stmt, d)
        return d

    def stmt(self, s: ast.stmt, d: Defined) -> Defined:
        if isinstance(s, ast.Assign):
            d = self.expr(s.value, d)
            for t in s.targets:
                d = self.target(t, d)
            return d
        if isinstance(s, ast.AugAssign):
            if isinstance(s.target, ast.Name):
                self.read(s.target.id, d)
                return self.bind([s.target.id], self.expr(s.value, d))
            return self.expr(s.value, self.target(s.target, d))
        if isinstance(s, ast.AnnAssign):
            if s.value is None:
                return d if isinstance(s.target, ast.Name) else self.expr(s.target, d)
            return self.target(s.target, self.expr(s.value, d))
        if isinstance(s, ast.Return | ast.Raise | ast.Break | ast.Continue):
            for child in ast.iter_child_nodes(s):
                d = self.expr(child, d)
            return None
        if isinstance(s, ast.Delete):
            for t in s.targets:
                plain = isinstance(t, ast.Name | ast.Tuple | ast.List)
                d = (d - _names(t) if d is not None else d) if plain else self.expr(t, d)
            return d
        if isinstance(s, ast.Import | ast.ImportFrom):
            return self.bind([(a.asname or a.name).split(".")[0] for a in s.names if a.name != "*"], d)
        if isinstance(s, ast.Global | ast.Nonlocal | ast.Pass):
            return d
        return self._compound(s, d)

    def _compound(self, s: ast.stmt, d: Defined) -> Defined:
        if isinstance(s, ast.If):
            d = self.expr(s.test, d)
            return _meet(self.block(s.body, d), self.block(s.orelse, d))
        if isinstance(s, ast.For | ast.AsyncFor | ast.While):
            return self._loop(s, d)
        if isinstance(s, ast.With | ast.AsyncWith):
            for item in s.items:
                d = self.expr(item.context_expr, d)
                if item.optional_vars is not None:
                    d = self.target(item.optional_vars, d)
            return self.block(s.body, d)
        if isinstance(s, ast.Try) or type(s).__name__ == "TryStar":  # ast.TryStar: Python 3.11+
            return self._try(cast(ast.Try, s), d)
        if isinstance(s, ast.Match):
            return self._match(s, d)
        if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return self._definition(s, d)
        for child in ast.iter_child_nodes(s):  # anything else (assert, expression): its reads
            d = self.expr(child, d) if isinstance(child, ast.expr) else d
        return d

    def _loop(self, s: ast.For | ast.AsyncFor | ast.While, d: Defined) -> Defined:
        if isinstance(s, ast.While):
            d = self.expr(s.test, d)
            body_out = self.block(s.body, d)
            forever = isinstance(s.test, ast.Constant) and bool(s.test.value)
            if forever and not _has_break(s.body):
                return None
        else:
            d = self.expr(s.iter, d)
            body_out = self.block(s.body, self.target(s.target, d))  # bound only when the body runs
        if self.loops_run and body_out is not None:
            d = body_out
        after = self.block(s.orelse, d)  # (unless loops_run) the body may run zero times
        return _meet(after, d) if _has_break(s.body) else after

    def _try(self, s: ast.Try, d: Defined) -> Defined:
        body_out = self.block(s.body, d)
        ends = [self.block(s.orelse, body_out)]
        for h in s.handlers:
            hd = self.expr(h.type, d)  # the body may have stopped anywhere
            hd = self.bind([h.name], hd) if h.name else hd
            out = self.block(h.body, hd)
            ends.append(out - {h.name} if out is not None and h.name else out)
        normal = _meet(*ends)
        if not s.finalbody:
            return normal
        self.block(s.finalbody, d)  # after an exception anywhere: only its reads matter
        return None if normal is None else self.block(s.finalbody, normal)

    def _match(self, s: ast.Match, d: Defined) -> Defined:
        d = self.expr(s.subject, d)
        ends: list[Defined] = [d]  # no case may match
        for case in s.cases:
            cd = d
            for node in ast.walk(case.pattern):
                if isinstance(node, ast.MatchValue):
                    cd = self.expr(node.value, cd)
                elif isinstance(node, ast.MatchClass):
                    cd = self.expr(node.cls, cd)
                name = getattr(node, "name", None) or getattr(node, "rest", None)
                if isinstance(name, str):
                    cd = self.bind([name], cd)
            ends.append(self.block(case.body, self.expr(case.guard, cd)))
        return _meet(*ends)

    def _definition(self, s: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, d: Defined) -> Defined:
        for deco in s.decorator_list:
            d = self.expr(deco, d)
        if isinstance(s, ast.ClassDef):
            for base in (*s.bases, *(k.value for k in s.keywords)):
                d = self.expr(base, d)
        else:
            d = self._defaults(s.args, d)
        self.nested(s, d)
        return self.bind([s.name], d)
