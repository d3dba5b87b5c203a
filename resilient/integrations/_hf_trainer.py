"""The Hugging Face ``Trainer``'s loop under the runtime: its steps, its position, its state.

One optimizer step of the Trainer is one step of the runtime. A step begins where the Trainer
fetches the batches of an optimizer step (``get_batch_samples``) and ends where the next one
fetches its batches (or where ``train()`` returns): what comes after an optimizer step (logging,
evaluation, the Trainer's own checkpoint, the end of an epoch and the start of the next) belongs to
that step, so a snapshot is taken where nothing has drawn from the RNGs for the next step yet.
The first step begins at ``on_train_begin``, once the Trainer built its optimizer, scheduler and
wrapped model: that first ``ctx.begin_step()`` restores them (in the same process after a soft
fault; from shared memory, a peer or a checkpoint in a process ``resilient launch`` started).

A restore to the middle of an epoch is handed to the Trainer's own resume path (``_run_epoch``'s
``epochs_trained``/``steps_trained_in_current_epoch``: accelerate's ``skip_first_batches`` skips
the consumed batches' indices, no sample is read), with the RNGs kept exact: the resumed pass
draws its sampler permutation and loader seed from the RNG state its original pass began from,
then the RNGs are put back where the snapshot left them, before the step's first forward.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

from resilient.errors import ResilienceError, StateRestoreError
from resilient.runtime.context import Context
from resilient.state.registry import capture_rng, restore_rng

# a resume_from_checkpoint under which no file lives: the Trainer's resume path skips batches, and
# finds no RNG file of its own to load over the restored RNGs
NO_CHECKPOINT = "<resilient: restored in memory>"
# log keys that are wall-clock measurements, not training state (two fault-free runs differ there)
MEASURED = ("_runtime", "_per_second")
_EPOCH_PARAMS = ("epoch", "resume_from_checkpoint", "epochs_trained", "steps_trained_in_current_epoch")

_trained: weakref.WeakSet[Context] = weakref.WeakSet()  # entries that ran a resilient train()


class UnsupportedTrainer(ResilienceError):
    """A Trainer (or its arguments) the integration cannot make resilient; the message names why."""


def check(trainer: Any) -> None:
    """Refuse, by name, what would break the promise of an exact resume."""
    missing = [n for n in ("_run_epoch", "get_batch_samples", "callback_handler") if not hasattr(trainer, n)]
    run_epoch = getattr(trainer, "_run_epoch", None)
    if run_epoch is not None:
        missing += [p for p in _EPOCH_PARAMS if p not in inspect.signature(run_epoch).parameters]
    if missing:
        import transformers

        raise UnsupportedTrainer(
            f"{type(trainer).__name__}: this transformers ({transformers.__version__}) has no "
            f"{', '.join(missing)} (resilient.integrations.hf follows the loop of transformers 5.x)"
        )
    args = trainer.args
    for flag, why in (
        ("auto_find_batch_size", "it retries the loop itself after an out-of-memory error"),
        ("ignore_data_skip", "a restore would run the epoch's first batches again"),
    ):
        if getattr(args, flag, False):
            raise UnsupportedTrainer(f"TrainingArguments({flag}=True) is not supported: {why}")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise UnsupportedTrainer("a DeepSpeed Trainer is not supported (its engine keeps its own state)")


def _generators(loader: Any) -> dict[str, torch.Generator]:
    """The torch generators a prepared loader draws from, each once, by where it was found (the
    loader's, its samplers', its dataset's: accelerate nests samplers in its batch samplers).
    A ``SeedableRandomSampler``'s is left out: it is seeded afresh at each pass (and made at the
    first), so its state says nothing."""
    from accelerate.data_loader import SeedableRandomSampler

    out: dict[str, torch.Generator] = {}
    seen: list[Any] = []

    def walk(obj: Any, path: str, depth: int) -> None:
        if obj is None or depth > 4 or any(obj is s for s in seen):
            return
        seen.append(obj)
        g = None if isinstance(obj, SeedableRandomSampler) else getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not h for h in out.values()):
            out[f"{path}generator"] = g
        for name in ("batch_sampler", "sampler"):
            walk(getattr(obj, name, None), f"{path}{name}.", depth + 1)

    g = getattr(loader, "synchronized_generator", None)
    if isinstance(g, torch.Generator):
        out["synchronized_generator"] = g
    walk(loader, "", 0)
    walk(getattr(loader, "dataset", None), "dataset.", 3)
    return out


def _states(gens: dict[str, torch.Generator]) -> dict[str, torch.Tensor]:
    return {k: g.get_state() for k, g in gens.items()}


def _set_states(gens: dict[str, torch.Generator], states: dict[str, torch.Tensor]) -> None:
    # (a generator a sampler creates at its first pass is absent before it: seeded then, nothing to set)
    for k, st in states.items():
        if k in gens:
            gens[k].set_state(st)


def _stateful_callbacks(trainer: Any) -> list[Any]:
    from transformers.trainer_callback import ExportableState

    return [
        cb for cb in [*trainer.callback_handler.callbacks, trainer.control] if isinstance(cb, ExportableState)
    ]


class Progress:
    """The Trainer's loop as tracked state (``ctx.track(trainer=...)``): its ``TrainerState``
    (global step, epoch, log history, best metric), the state of its stateful callbacks and its
    ``TrainerControl``, its loss and FLOP accumulators, and the position inside the epoch with the
    RNG states that epoch's pass began from."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.epoch = 0  # the epoch being run
        self.updates = 0  # optimizer steps that fetched their batches in it
        self.batches = 0  # the batches they fetched
        self.started = False  # a step fetched batches (the first snapshot, at train begin, precedes it)
        self.finished = False  # train() returned
        # the torch RNG when this epoch's pass began (where a sampler and the loader draw a seed)
        self.pass_rng: torch.Tensor | None = None
        self.pass_generators: dict[str, torch.Tensor] = {}  # ... and the train loader's generators
        self.generators: dict[str, torch.Tensor] = {}  # the loader's generators as restored
        self.loaded = False

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        state = {f.name: getattr(t.state, f.name) for f in dataclasses.fields(t.state)}
        state["log_history"] = [
            {k: v for k, v in entry.items() if not k.endswith(MEASURED)} for entry in t.state.log_history
        ]
        loader = t.callback_handler.train_dataloader
        return {
            "position": {
                "epoch": self.epoch,
                "updates": self.updates,
                "batches": self.batches,
                "started": self.started,
                "finished": self.finished,
            },
            "state": state,
            "callbacks": [{"name": type(cb).__name__, "state": cb.state()} for cb in _stateful_callbacks(t)],
            "accumulators": {
                "tr_loss": t._tr_loss.detach().clone(),  # (added to in place by the next step)
                "total_loss": t._total_loss_scalar,
                "last_logged": t._globalstep_last_logged,
                "flos": t.current_flos,
            },
            "pass": {"rng": self.pass_rng, "generators": self.pass_generators},
            "generators": _states(_generators(loader)) if loader is not None else {},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        t = self.trainer
        pos = sd["position"]
        self.epoch, self.updates, self.batches = int(pos["epoch"]), int(pos["updates"]), int(pos["batches"])
        self.started, self.finished = bool(pos["started"]), bool(pos["finished"])
        for name, value in sd["state"].items():
            setattr(t.state, name, value)
        live = _stateful_callbacks(t)
        names = [type(cb).__name__ for cb in live]
        if names != [c["name"] for c in sd["callbacks"]]:
            raise StateRestoreError(
                f"the Trainer's stateful callbacks were {[c['name'] for c in sd['callbacks']]} when the "
                f"snapshot was taken, and are {names} now"
            )
        for cb, saved in zip(live, sd["callbacks"], strict=True):
            for key in ("args", "attributes") if _is_control(cb) else ("attributes",):
                for attr, value in saved["state"].get(key, {}).items():
                    setattr(cb, attr, value)
        acc = sd["accumulators"]
        t._tr_loss = acc["tr_loss"]
        t._total_loss_scalar = acc["total_loss"]
        t._globalstep_last_logged = acc["last_logged"]
        t.current_flos = acc["flos"]
        self.pass_rng, self.pass_generators = sd["pass"]["rng"], dict(sd["pass"]["generators"])
        self.generators = dict(sd["generators"])
        self.loaded = True


def _is_control(cb: Any) -> bool:
    from transformers.trainer_callback import TrainerControl

    return isinstance(cb, TrainerControl)


def tracked(trainer: Any) -> dict[str, Any]:
    """What is restored besides the loop: the wrapped model (DDP's, so that the runtime's replica
    checks see it), the optimizer accelerate wraps (its inner one: the step hooks fire there),
    the scheduler and, under fp16, the gradient scaler."""
    model = trainer.model_wrapped if trainer.model_wrapped is not None else trainer.model
    opt = trainer.optimizer
    inner = getattr(opt, "optimizer", None)
    objects = {"model": model, "optimizer": inner if isinstance(inner, torch.optim.Optimizer) else opt}
    if trainer.lr_scheduler is not None:
        objects["scheduler"] = trainer.lr_scheduler
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is not None:
        objects["scaler"] = scaler
    return objects


class TrainerLoop:
    """One resilient ``trainer.train()`` call (see the module docstring)."""

    def __init__(self, ctx: Context, trainer: Any) -> None:
        check(trainer)
        if ctx in _trained:
            raise UnsupportedTrainer(
                "a second trainer.train() in one entry of the wrapped function: a restore could not tell "
                "which of them it belongs to (train once per function, or wrap each in its own function)"
            )
        self.ctx, self.trainer = ctx, trainer
        self.progress = Progress(trainer)
        self.open = False  # a step is begun and not ended
        self.fetched = False  # this entry's first step fetched its batches
        self.resume: tuple[int, int] | None = None  # (epoch, batches consumed) of a restored position
        self.restored_rng: dict[str, Any] | None = None  # what the restore left, until the first fetch
        self.iterator: Any = None  # the epoch iterator being read
        self.eval_on_start = False  # turned off while a restored run starts (it ran before the fault)

    def run(self, call: Callable[[], Any]) -> Any:
        t = self.trainer
        _trained.add(self.ctx)
        callback = _callback(self)
        t.callback_handler.callbacks.insert(0, callback)  # first: later callbacks see restored state
        own = {n: t.__dict__[n] for n in ("_run_epoch", "get_batch_samples") if n in t.__dict__}
        t._run_epoch = self._run_epoch(t._run_epoch)
        t.get_batch_samples = self._get_batch_samples(t.get_batch_samples)
        ok = False
        try:
            out = call()
            ok = True
        finally:
            for n in ("_run_epoch", "get_batch_samples"):
                if n in own:
                    setattr(t, n, own[n])
                else:
                    t.__dict__.pop(n, None)
            if callback in t.callback_handler.callbacks:
                t.callback_handler.callbacks.remove(callback)
            if self.eval_on_start:
                t.args.eval_on_start, self.eval_on_start = True, False
            if not ok:
                _release_loaders()
        self.progress.finished = True
        if self.open:  # the last step: everything train() did after its last optimizer step
            self.open = False
            self.ctx.end_step()
        return out

    # -- the Trainer's events ----------------------------------------------------------------------
    def train_begins(self) -> None:
        """Everything the loop restores exists now: track it, begin the first step (restoring)."""
        t, p = self.trainer, self.progress
        self.ctx.track(**tracked(t), trainer=p)
        self.ctx.begin_step()
        self.open = True
        if p.loaded and p.started:
            self.resume = (p.epoch, p.batches)
            self.restored_rng = capture_rng()
            if t.args.eval_on_start:
                t.args.eval_on_start, self.eval_on_start = False, True

    def _run_epoch(self, run_epoch: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(run_epoch)

        def run(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            a = bound.arguments
            p, epoch = self.progress, int(a["epoch"])
            if self.eval_on_start:
                self.trainer.args.eval_on_start, self.eval_on_start = True, False
            if self.resume is not None:
                start, batches = self.resume
                if p.finished or epoch < start:  # done before the restored step
                    return None
                # the Trainer's own resume: skip the consumed batches' indices; no RNG file here
                a.update(
                    resume_from_checkpoint=NO_CHECKPOINT,
                    epochs_trained=start,
                    steps_trained_in_current_epoch=batches,
                )
                if epoch == start:
                    return run_epoch(*bound.args, **bound.kwargs)
            p.epoch, p.updates, p.batches = epoch, 0, 0
            if a["resume_from_checkpoint"] is not None and epoch == a["epochs_trained"]:
                # the Trainer resumes its own checkpoint: this pass begins after the batches it skips
                p.batches = int(a["steps_trained_in_current_epoch"])
                p.updates = p.batches // self.trainer.args.gradient_accumulation_steps
            return run_epoch(*bound.args, **bound.kwargs)

        return run

    def _get_batch_samples(self, fetch: Callable[..., Any]) -> Callable[..., Any]:
        def get(epoch_iterator: Any, num_batches: int, *args: Any, **kwargs: Any) -> Any:
            ctx, p = self.ctx, self.progress
            if self.fetched:  # the previous optimizer step and all that followed it are complete
                ctx.end_step()
                self.open = False
                ctx.begin_step()
                self.open = True
            self.fetched = p.started = True
            restored, self.restored_rng = self.restored_rng, None
            gens = _generators(self.trainer.callback_handler.train_dataloader)
            mid_pass = restored is not None and p.batches > 0
            if mid_pass:  # the resumed pass draws as its original did when it began
                assert p.pass_rng is not None
                torch.set_rng_state(p.pass_rng)
                _set_states(gens, p.pass_generators)
            elif restored is not None:  # a pass begins now, as it did in the original run
                restore_rng(restored)
                _set_states(gens, p.generators)
            if epoch_iterator is not self.iterator:
                self.iterator = epoch_iterator
                if not mid_pass:
                    p.pass_rng, p.pass_generators = torch.get_rng_state(), _states(gens)
            out = fetch(epoch_iterator, num_batches, *args, **kwargs)
            if mid_pass:
                assert restored is not None
                restore_rng(restored)  # the step's own draws (dropout) continue the snapshot's stream
            p.updates += 1
            p.batches += len(out[0])
            return out

        return get


def _release_loaders() -> None:
    """A train() left by a fault leaves its loaders registered with accelerate's ``GradientState``
    (a pass ends there only when it runs out): the next one would find theirs stale underneath."""
    from accelerate.state import GradientState

    gs = GradientState()
    for dl in [d for d in getattr(gs, "dataloader_references", []) if d is not None]:
        end = getattr(dl, "end", None)
        if callable(end):
            end()


def _callback(loop: TrainerLoop) -> Any:
    from transformers import TrainerCallback

    class ResilientCallback(TrainerCallback):
        """Begins the first step once the Trainer built what it trains (see the module docstring)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            loop.train_begins()

    return ResilientCallback()
