"""The untracked-state scan on real frames: training functions driven by a fake ``ctx.steps``
generator that samples its caller's frame at the start of each step, as the runtime will; and the
liveness analysis that tells which locals a step loop carries from one step to the next."""

from __future__ import annotations

import copy
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from resilient.errors import ConfigError
from resilient.state.carry import Carried
from resilient.state.liveness import LoopNames, step_loop_names
from resilient.state.untracked import CLOCKS, LOADER_DOC, Finding, UntrackedScan, message

STEPS = 5


class FakeCtx:
    """``ctx.track``/``ctx.carry``/``ctx.steps``/``ctx.epochs`` with the scan where the runtime
    puts it: inside the steps generator, whose caller (frame 1) is the training function."""

    # the runtime's own objects (its ctx among them) are never findings: this stand-in is one
    __module__ = "resilient.testing"

    def __init__(self, samples: int = 3, clocks: tuple[Callable[[], float], ...] | None = None) -> None:
        self.scan = UntrackedScan(samples=samples, clocks=CLOCKS if clocks is None else clocks)
        self.tracked: list[Any] = []
        self.carried: Carried | None = None
        self.findings: list[Finding] | None = None
        self.observed = 0

    def track(self, **objects: Any) -> None:
        self.tracked += objects.values()

    def carry(self, **values: Any) -> Carried:
        self.carried = Carried(**values)
        self.tracked.append(self.carried)
        return self.carried

    def steps(self, source: int | Iterable[Any]) -> Iterator[Any]:
        for item in range(source) if isinstance(source, int) else source:
            if not self.scan.done:
                names = set(self.carried.fields()) if self.carried is not None else set()
                found = self.scan.observe(sys._getframe(1), tracked=self.tracked, carried_names=names)
                self.observed += 1
                if found is not None:
                    self.findings = found
            yield item

    def epochs(self, n: int) -> Iterator[int]:
        yield from range(n)


def run(fn: Any, *args: Any, ctx: FakeCtx | None = None) -> list[Finding]:
    ctx = ctx or FakeCtx()
    fn(ctx, *args)
    assert ctx.findings is not None, "the scan never reported"
    return ctx.findings


def names(findings: list[Finding]) -> list[str]:
    return [f.name for f in findings]


# ---- training functions (module level: their source is what the scan reads) ----------------


class DataLoaderLite:
    """build-nanogpt's loader: its position lives in plain attributes."""

    def __init__(self, tokens: torch.Tensor, B: int, T: int) -> None:
        self.tokens, self.B, self.T = tokens, B, T
        self.shards = ["shard_00"]
        self.current_shard = 0
        self.current_position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.B * self.T
        buf = self.tokens[self.current_position : self.current_position + n + 1]
        self.current_position += n
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)


class StatefulLoaderLite(DataLoaderLite):
    def state_dict(self) -> dict[str, int]:
        return {"current_position": self.current_position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.current_position = state["current_position"]


class DDPLike(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def sgd_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 4), torch.randn(2, 4)


def train_with_loader(ctx: FakeCtx, loader_cls: type[DataLoaderLite], track_loader: bool) -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = loader_cls(torch.arange(1000.0), 2, 4)
    ctx.track(model=model, optimizer=optimizer)
    if track_loader:
        ctx.track(train_loader=train_loader)
    for _step in ctx.steps(STEPS):
        x, y = train_loader.next_batch()
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def train_with_ema(ctx: FakeCtx, track_ema: bool) -> None:
    model = torch.nn.Linear(4, 4)
    ema = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, optimizer=optimizer)
    if track_ema:
        ctx.track(ema=ema)
    for step in ctx.steps(STEPS):
        sgd_step(model, optimizer, torch.ones(2, 4) * (step + 1))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
                pe.mul_(0.9).add_(pm, alpha=0.1)


def train_with_counter(ctx: FakeCtx) -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, optimizer=optimizer)
    iter_num = 0
    for _step in ctx.steps(STEPS):
        lr = 0.1 * (iter_num + 1) / STEPS
        for group in optimizer.param_groups:
            group["lr"] = lr
        sgd_step(model, optimizer, torch.ones(2, 4))
        iter_num += 1  # noqa: SIM113 (a counter kept by hand is what the scan must find)


def train_running_mean(ctx: FakeCtx) -> None:
    for step in ctx.steps(STEPS):
        loss = float(step)
        running = loss if step == 0 else 0.9 * running + 0.1 * loss  # noqa: F821 (bound at step 0)
        assert running >= 0


master_process = False


def train_quiet(ctx: FakeCtx, loader: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """nanoGPT's habits that are not state a restart loses (or that the runtime restores)."""
    global master_process
    master_process = True
    model = DDPLike(torch.nn.Linear(4, 4))
    raw_model = model.module
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ctx.track(model=model, optimizer=optimizer)
    carry = ctx.carry(seen=0)
    best_val_loss = 1e9
    config = {"lr": 0.01, "batch": 2}
    t0 = time.time()
    for x, y in ctx.steps(loader):
        for _micro_step in range(2):  # gradient accumulation: loss is read after the loop
            logits = model(x)
            loss = torch.nn.functional.mse_loss(logits, y) / 2
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        val = loss.item()
        if best_val_loss == 1e9:
            best_val_loss = val  # changes once, not every step
        carry.seen += 1
        t1 = time.time()
        dt = t1 - t0
        t0 = t1
        if master_process and dt < 0:
            print(raw_model, config)


def train_prefetch(ctx: FakeCtx) -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, optimizer=optimizer)
    x, y = get_batch()
    for _step in ctx.steps(STEPS):
        loss = (model(x) - y).pow(2).mean()
        x, y = get_batch()  # prefetched for the next step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def train_epochs(ctx: FakeCtx, loader: DataLoader) -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, optimizer=optimizer, loader=loader)
    samples_seen = 0
    epoch_losses = []
    for epoch in ctx.epochs(3):
        for (x,) in ctx.steps(loader):
            loss = sgd_step(model, optimizer, x + epoch)
            samples_seen += x.shape[0]
        epoch_losses.append(loss)  # the last step's: read after the inner loop, not carried


def train_iterator(ctx: FakeCtx, loader: DataLoader, track_loader: bool) -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model=model, optimizer=optimizer)
    if track_loader:
        ctx.track(loader=loader)
    it = iter(loader)
    for _step in ctx.steps(STEPS):
        (x,) = next(it)
        sgd_step(model, optimizer, x)


_COUNTER = 0
_BUMPS = 0


def train_global(ctx: FakeCtx) -> None:
    global _COUNTER

    def bump() -> None:
        global _BUMPS
        _BUMPS += 1

    for _step in ctx.steps(STEPS):
        _COUNTER += 1
        bump()


def train_own_generators(ctx: FakeCtx) -> None:
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    losses: list[float] = []
    for _step in ctx.steps(STEPS):
        losses.append(float(torch.randn(3, generator=gen).sum() + rng.normal()))


# ---- the scan on real frames -----------------------------------------------------------------


def test_a_hand_written_loader_names_its_position_attribute() -> None:
    assert run(train_with_loader, DataLoaderLite, False) == [
        Finding(
            name="train_loader.current_position",
            kind="object",
            type_name="DataLoaderLite",
            fix=f"give DataLoaderLite a state_dict()/load_state_dict() ({LOADER_DOC}) "
            "and ctx.track(train_loader=train_loader)",
        )
    ]


def test_a_tracked_loader_with_a_state_dict_is_not_a_finding() -> None:
    assert run(train_with_loader, StatefulLoaderLite, True) == []


def test_an_untracked_object_with_a_state_dict_is_one_finding_that_tracks_it() -> None:
    assert run(train_with_loader, StatefulLoaderLite, False) == [
        Finding("train_loader", "object", "StatefulLoaderLite", "ctx.track(train_loader=train_loader)")
    ]


def test_an_untracked_ema_module_is_a_finding_and_a_tracked_one_is_not() -> None:
    assert run(train_with_ema, False) == [Finding("ema", "object", "Linear", "ctx.track(ema=ema)")]
    assert run(train_with_ema, True) == []


def test_a_counter_carried_in_a_local_is_a_finding() -> None:
    assert run(train_with_counter) == [
        Finding(
            "iter_num", "carried local", "int", "carry = ctx.carry(iter_num=iter_num) and use carry.iter_num"
        )
    ]


def test_a_counter_first_bound_in_the_loop_is_a_finding() -> None:
    assert names(run(train_running_mean)) == ["running"]


def test_temporaries_targets_values_changing_once_globals_set_once_and_wrapped_models_are_not() -> None:
    loader = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(STEPS)]
    assert run(train_quiet, loader) == []


def test_a_clock_reading_carried_for_timing_is_not_state() -> None:
    loader = [(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(STEPS)]
    assert names(run(train_quiet, loader, ctx=FakeCtx(clocks=()))) == ["t0"]  # no clock to compare


def test_the_module_behind_an_untracked_wrapper_is_named() -> None:
    def train(ctx: FakeCtx) -> None:
        model = DDPLike(torch.nn.Linear(4, 4))
        raw_model = model.module
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state of its own
        for _step in ctx.steps(STEPS):
            sgd_step(raw_model, optimizer, torch.ones(2, 4))

    assert sorted(names(run(train))) == ["model", "raw_model"]


def test_a_batch_prefetched_at_a_steps_end_is_a_finding() -> None:
    found = run(train_prefetch)
    assert names(found) == ["x", "y"]
    assert {f.kind for f in found} == {"carried local"} and found[0].type_name == "Tensor"
    assert found[0].fix == "carry = ctx.carry(x=x) and use carry.x"


def test_an_epoch_loop_counter_is_a_finding_and_the_runtimes_loader_iterator_is_not() -> None:
    loader = DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=2)
    ctx = FakeCtx()
    train_epochs(ctx, loader)
    assert ctx.observed == 3  # sampled across the epochs' boundary
    assert ctx.findings is not None and names(ctx.findings) == ["samples_seen"]


def test_an_untracked_optimizer_is_a_finding_though_it_has_no_state_before_its_first_step() -> None:
    def train(ctx: FakeCtx, loader: DataLoader) -> None:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ctx.track(model=model)
        for (x,) in ctx.steps(loader):  # an untracked loader, iterated by the runtime: not a finding
            sgd_step(model, optimizer, x)

    loader = DataLoader(TensorDataset(torch.randn(20, 4)), batch_size=2, shuffle=True)
    assert run(train, loader) == [Finding("optimizer", "object", "SGD", "ctx.track(optimizer=optimizer)")]


def test_an_iterator_over_an_untracked_loader_is_a_finding() -> None:
    loader = DataLoader(TensorDataset(torch.randn(20, 4)), batch_size=2)
    found = run(train_iterator, loader, False)
    assert names(found) == ["it"]
    assert found[0].fix == "ctx.track(loader=loader) and iterate ctx.steps(loader) in place of next(it)"
    assert run(train_iterator, loader, True) == []


def test_globals_written_in_the_step_are_findings() -> None:
    found = run(train_global)
    assert names(found) == ["_BUMPS", "_COUNTER"]
    assert {f.kind for f in found} == {"global"}
    assert found[1].fix.startswith("keep it in ctx.carry instead of a global")


def test_generators_of_its_own_and_a_growing_list_are_findings() -> None:
    found = {f.name: f for f in run(train_own_generators)}
    assert sorted(found) == ["gen", "losses", "rng"]
    assert found["gen"].fix == "ctx.track(gen=gen)"
    assert "rng.bit_generator.state" in found["rng"].fix
    assert found["losses"].fix == "carry = ctx.carry(losses=losses) and use carry.losses"


EXEC_SOURCE = """
def train_exec(ctx, loader_cls):
    train_loader = loader_cls(torch.arange(1000.0), 2, 4)
    iter_num = 0
    for step in ctx.steps(5):
        x, y = train_loader.next_batch()
        iter_num += 1
"""


def test_without_source_only_objects_are_found() -> None:
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(EXEC_SOURCE, "<no file>", "exec"), namespace)
    assert names(run(namespace["train_exec"], DataLoaderLite)) == ["train_loader.current_position"]


def test_the_scan_reports_once_then_does_nothing() -> None:
    scan = UntrackedScan(samples=2)
    frame = sys._getframe()
    assert scan.observe(frame) is None and not scan.done
    assert scan.observe(frame) == [] and scan.done
    assert scan.observe(frame) is None
    with pytest.raises(ConfigError, match="samples=1"):
        UntrackedScan(samples=1)


def test_message_groups_findings_by_fix() -> None:
    assert message([]) == ""
    text = message(
        [
            Finding("x", "carried local", "Tensor", "carry x"),
            Finding("loader.pos", "object", "L", "fix L"),
            Finding("loader.epoch", "object", "L", "fix L"),
        ]
    )
    assert "x: carry x; loader.pos, loader.epoch: fix L" in text


# ---- the liveness analysis ------------------------------------------------------------------


def loop_names(body: str, head: str = "for step in ctx.steps(10):") -> LoopNames:
    source = f"def train(ctx):\n    {head}\n" + textwrap.indent(textwrap.dedent(body), "        ")
    found = step_loop_names(source)
    assert found is not None
    return found


def carried(body: str, head: str = "for step in ctx.steps(10):") -> set[str]:
    return set(loop_names(body, head).carried)


def test_if_else_assigns_only_what_every_branch_assigns() -> None:
    body = """
        if c:
            a = b = 1
        else:
            a = 2
        use(a, b)
        if c:
            r = 1
        else:
            continue
        use(r)
    """
    assert carried(body) == {"b"}


def test_inner_loops_may_run_zero_times() -> None:
    body = """
        for i in range(n):
            v = i
        while cond():
            w = 1
        use(v, w, i)
        while True:
            z = 1
            break
        use(z)
    """
    # z too: the analysis takes no loop's body to run for sure (conservative: its value decides)
    assert carried(body) == {"v", "w", "i", "z"}


def test_what_a_step_surely_hands_on_is_steady_and_a_read_after_an_accumulation_loop_is_not() -> None:
    body = """
        for micro_step in range(accum):
            loss = f()
        log(loss)
        n += 1
    """
    found = loop_names(body)
    assert found.carried == {"loss", "n"} and found.steady == {"n"}


def test_a_try_body_may_stop_anywhere() -> None:
    body = """
        try:
            a = f()
            b = g()
        except ValueError:
            a = 0
        finally:
            use(c)
        use(a, b)
        c = 1
    """
    assert carried(body) == {"b", "c"}


def test_augassign_reads_before_it_writes() -> None:
    body = """
        n += 1
        m = 0
        m += 1
    """
    assert carried(body) == {"n"}


def test_nested_scopes_read_their_free_names_and_keep_their_own_targets() -> None:
    body = """
        out = [k * z for k in range(3)]
        k = 1
        f = lambda q: q + s
        def h(p=d):
            return p + e
        z = s = d = e = 2
        use(out, f, h)
    """
    assert carried(body) == {"z", "s", "d", "e"}


def test_walrus_with_and_del() -> None:
    body = """
        if (n := f()) > 0:
            use(n)
        ok = c or (m := 1)
        use(m)
        with open(p) as fh:
            data = fh.read()
        use(data)
        u = 1
        del u
        use(t)
        t = 1
    """
    assert carried(body) == {"m", "t"}


def test_the_loops_own_targets_are_not_carried() -> None:
    assert carried("use(x)\nx = y = 2\n", head="for x, y in ctx.steps(loader):") == set()


def test_an_epoch_loop_adds_its_inner_step_loop_and_the_line_picks_the_loop() -> None:
    source = textwrap.dedent(
        """
        def train(ctx):
            for epoch in ctx.epochs(3):
                it = iter(loader)
                for x in ctx.steps(loader):
                    seen += 1
                    last = next(it)
                use(last)
            for step in ctx.steps(eval_loader):
                total = total + 1
        """
    )
    first = step_loop_names(source)
    assert first is not None
    assert first.carried == {"seen", "last"} and first.targets == {"epoch", "x"}
    assert first.assigned == {"x", "seen", "last"}
    second = step_loop_names(source, line=10)
    assert second is not None and second.carried == {"total"}
    assert step_loop_names("def f():\n    return 1\n") is None


def test_a_loop_over_a_kept_steps_generator_is_found_by_the_frames_line() -> None:
    source = "def train(ctx):\n    steps = ctx.steps(9)\n    for s in steps:\n        n += 1\n"
    assert step_loop_names(source) is None
    found = step_loop_names(source, line=3)
    assert found is not None and found.carried == {"n"} and found.targets == {"s"}
