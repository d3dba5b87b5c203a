"""The runtime's durable side: periodic checkpoints, resume at start, preemption.

- Every ``interval`` completed steps the tracked state is saved through a
  :class:`~resilient.checkpoint.Checkpointer`; the step waits only for the copy. With
  ``interval: auto`` rank 0 chooses each next save step from the measured save time and the fault
  rate seen so far (Young) and publishes it in the store, so every rank saves the same steps.
- At the first entry, the newest checkpoint that verifies on *every* rank is loaded (ranks vote on
  each candidate through the store, newest first).
- A preemption signal (SIGUSR1/SIGTERM) only sets a flag; the next step boundary turns it into a
  ``preempt`` fault, which pulls every rank out of its step through the usual fault path. After the
  recovery barrier agrees on the newest snapshot all ranks hold, that state is saved as the final
  checkpoint and the process exits with the requeue code.
- Under ``resilient launch`` a SIGTERM is also its agent's "stop now" (the agent marks that first):
  the process dies of it at once. Its Python handler runs only when the main thread is back in the
  interpreter, and one blocked in C++ (a recovery barrier's store ``wait`` for a dead peer, a
  collective) would outlive the agent's grace (30 s, then SIGKILL): a thread, woken by the
  signal itself (``signal.set_wakeup_fd``), ends the process when the main thread has not taken
  the signal within ``TERM_GRACE_S``.
- A failed save is reported (event + error log) and training continues: the previous checkpoints
  are intact. The final flush at the end of the run raises if it fails.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from loguru import logger

from resilient.checkpoint import flushed
from resilient.checkpoint.manager import Checkpointer
from resilient.checkpoint.manifest import tmp_dirs
from resilient.checkpoint.reader import Loaded
from resilient.checkpoint.writer import part_name, report_failure
from resilient.config import CheckpointConfig
from resilient.errors import CheckpointError, NoValidCheckpoint
from resilient.events import Event, EventLog
from resilient.runtime.coordination.coordinator import REDUCE

TERM_GRACE_S = 0.5  # the agent's SIGTERM: the main thread's handler runs by then unless it is blocked in C


class TermWatch(threading.Thread):
    """Ends the process on its agent's SIGTERM when the main thread does not run the Python handler
    within ``grace`` s (``handled`` not set): it is blocked in C++ and would outlive the agent's
    grace. The C-level handler Python installs writes each signal's number to the wakeup fd, from
    whatever thread the kernel interrupts: this thread sleeps in a ``read`` of it, nothing polls.
    Bytes are passed on to a wakeup fd there was before (an event loop's)."""

    def __init__(self, agent_stopping: Callable[[], bool], handled: threading.Event, grace: float, rank: int):
        super().__init__(name="resilient-term-watch", daemon=True)
        self._agent_stopping = agent_stopping
        self._handled = handled
        self._grace = grace
        self._rank = rank
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._previous_fd = -1

    def install(self) -> None:
        """From the main thread (``set_wakeup_fd`` may be called there only)."""
        self._previous_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
        _watches.append(self)
        self.start()

    def uninstall(self) -> None:
        """From the main thread: the previous wakeup fd back (unless another was set since), the
        thread ended, the pipe closed."""
        current = signal.set_wakeup_fd(self._previous_fd)
        if current != self._w:  # (someone set theirs since: it stays)
            signal.set_wakeup_fd(current)
        with contextlib.suppress(ValueError):
            _watches.remove(self)
        with contextlib.suppress(OSError):
            os.write(self._w, b"\0")  # (no signal is 0: the thread's end)
        self.join(1.0)
        if not self.is_alive():  # (else it still reads the pipe: left open)
            os.close(self._r)
            os.close(self._w)

    def forked(self) -> None:
        """In a child forked from this process: its signals are its own (no thread reads them here)."""
        with contextlib.suppress(ValueError, OSError):  # (forked from another thread than the main)
            if signal.set_wakeup_fd(self._previous_fd) != self._w:
                signal.set_wakeup_fd(-1)
        with contextlib.suppress(OSError):
            os.close(self._r)
            os.close(self._w)

    def run(self) -> None:
        while True:
            try:
                got = os.read(self._r, 64)
            except OSError:
                return
            if not got:
                return
            signums = got.replace(b"\0", b"")
            if signums and self._previous_fd >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._previous_fd, signums)
            stop = signal.SIGTERM in signums and self._agent_stopping()
            if stop and not self._handled.wait(self._grace):
                self._die()
            if b"\0" in got:
                return

    def _die(self) -> None:
        """Dies of SIGTERM, as the handler would have: its default action, from this thread. (The
        event log is written unbuffered: nothing of it is lost.)"""
        with contextlib.suppress(OSError):
            os.write(
                2,
                f"rank {self._rank}: SIGTERM from its agent while the main thread is blocked (a store wait, "
                f"a collective): the process ends now\n".encode(),
            )
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).signal(int(signal.SIGTERM), 0)  # SIG_DFL (signal.signal: the main thread only)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)  # (the kernel ends every thread: this one too)
        os._exit(128 + signal.SIGTERM)


_watches: list[TermWatch] = []  # this process's (at most one)


def _after_fork_in_child() -> None:
    for w in _watches:
        w.forked()
    _watches.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Persistence:
    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        rank: int,
        world_size: int,
        token: str,
        events: EventLog,
        exchange: Callable[[str, str], list[str]],
        signals: tuple[str, ...] | None = None,
        agree: Callable[[str, str, str], str] | None = None,
        agent_stopping: Callable[[], bool] | None = None,
    ) -> None:
        assert cfg.dir is not None
        self.cfg = cfg
        # `resilient launch` stops workers with SIGTERM and forwards preemption as SIGUSR1;
        # ``agent_stopping``: under it, whether a SIGTERM is the agent's (stop now) or a
        # scheduler's, which signals every process of a job step (a preemption: checkpoint first)
        self.signals = signals
        self.agent_stopping = agent_stopping
        self.rank = rank
        self.events = events
        self._exchange = exchange  # (name, payload) -> every rank's payload, through the store
        # (name, payload, how) -> one value reduced from every rank's (coordinator.REDUCE): what a
        # vote needs, without every rank reading every payload
        self._agree = agree or (lambda name, payload, how: REDUCE[how](exchange(name, payload)))
        self.ckpt = Checkpointer.from_config(
            cfg, rank=rank, world_size=world_size, token=token, any_busy=self._any_busy
        )
        self.next_save: int | None = cfg.interval if isinstance(cfg.interval, int) else 1
        self.failures = 0
        self.preempt_requested: str | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._term_taken = threading.Event()  # the main thread ran _on_term for the agent's SIGTERM
        self._term_watch: TermWatch | None = None
        self._t0 = time.monotonic()
        self._save_started: dict[int, float] = {}
        self._write_s: float | None = None
        self._step_s: float | None = None
        self._last_step_t: float | None = None

    def _any_busy(self, step: int, busy: bool) -> bool:
        return self._agree(f"ckpt_busy{step}", "1" if busy else "0", "any") == "1"

    # ---- preemption signals ------------------------------------------------------------------
    def install(self) -> None:
        for name in self.signals or self.cfg.preempt_signals:
            signum = getattr(signal, name)
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        if self.agent_stopping is not None and signal.SIGTERM not in self._previous_handlers:
            self._previous_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_term)
            self._term_taken.clear()
            self._term_watch = TermWatch(self.agent_stopping, self._term_taken, TERM_GRACE_S, self.rank)
            self._term_watch.install()

    def _on_term(self, signum: int, frame: Any) -> None:
        """A SIGTERM under ``resilient launch``: the agent's stops the process as it always did;
        anyone else's (Slurm's) asks for the final checkpoint, as SIGUSR1 does."""
        assert self.agent_stopping is not None
        if not self.agent_stopping():
            self._on_signal(signum, frame)
            return
        self._term_taken.set()  # (the main thread has it: the watch leaves it alone)
        previous = self._previous_handlers.get(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def uninstall(self) -> None:
        if self._term_watch is not None:
            self._term_watch.uninstall()
            self._term_watch = None
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.preempt_requested = signal.Signals(signum).name  # acted on at the next step boundary

    # ---- resume --------------------------------------------------------------------------------
    def resume(self, meshes: list[Any] | None = None) -> Loaded | None:
        """The newest checkpoint that verifies on every rank, or None. One written at another world
        size is resharded onto ``meshes`` (the device meshes the tracked objects live on)."""
        if not self.cfg.resume:
            return None
        rounds = iter(range(1 << 30))

        def agree(ok: bool) -> bool:
            return self._agree(f"ckpt_vote{next(rounds)}", "1" if ok else "0", "all") == "1"

        from resilient.checkpoint.reader import load_latest

        t0 = time.time()
        local_error: NoValidCheckpoint | None = None
        try:
            loaded = load_latest(self.ckpt.root, self.rank, self.ckpt.world_size, agree=agree, meshes=meshes)
        except NoValidCheckpoint as e:
            loaded, local_error = None, e
        if loaded is None and (local_error is not None or self.ckpt.tier is not None):
            loaded = self._from_tier(local_error)
        if loaded is not None:
            tried = loaded.rejected + (local_error.tried if local_error else [])
            bad = loaded.rejected_steps + (local_error.steps if local_error else [])
            for why in tried:  # a corrupt newest checkpoint is a fault too: say so
                self.events.emit(Event.CHECKPOINT_REJECTED, generation=0, step=None, reason=why)
            if self.rank == 0:  # every rank voted it bad: out of the committed set, kept for a look
                from resilient.checkpoint.manifest import quarantine

                for step in bad:
                    moved = quarantine(self.ckpt.root, step)
                    if moved is not None:
                        logger.warning(f"checkpoint step {step} does not verify: moved to {moved}")
            resharded: dict[str, Any] = {}
            if loaded.resharded_from is not None:
                resharded = {"resharded_from": loaded.resharded_from, "per_rank_from": loaded.per_rank_from}
                if loaded.per_rank_from:
                    logger.warning(
                        f"rank {self.rank}: checkpoint step {loaded.step} was written by "
                        f"{loaded.resharded_from} ranks; per-rank objects {sorted(loaded.per_rank_from)} "
                        f"(different on every old rank: RNG states, a data position) are old rank "
                        f"{next(iter(loaded.per_rank_from.values()))}'s"
                    )
            self.events.emit(
                Event.CHECKPOINT_LOADED,
                generation=0,
                step=loaded.step,
                path=str(loaded.path),
                duration_s=time.time() - t0,
                **resharded,
            )
        return loaded

    def _from_tier(self, local_error: NoValidCheckpoint | None) -> Loaded | None:
        """Nothing valid here: the newest persistent-tier checkpoint every rank can load, agreed
        through the store (each rank fetches its own part). Re-raises the local error otherwise."""
        if self.ckpt.tier is None:
            if local_error is not None:
                raise local_error
            return None
        loaded = self.ckpt.load_from_tier(None)
        steps = self._exchange("ckpt_tier_step", str(loaded.step if loaded is not None else -1))
        if len(set(steps)) == 1 and steps[0] != "-1":
            return loaded
        if local_error is not None:
            raise NoValidCheckpoint(
                f"{local_error}\nnor one from {self.ckpt.tier.url} (steps per rank: {steps})"
            )
        if any(s != "-1" for s in steps):
            raise NoValidCheckpoint(
                f"no checkpoint of {self.ckpt.tier.url} loads on every rank (steps per rank: {steps})"
            )
        return None

    # ---- saving --------------------------------------------------------------------------------
    def settle(
        self, generation: int, step: int | None, *, fault: tuple[int, int | None] | None = None
    ) -> None:
        """Wait for the save in flight, if any (its failure is a checkpoint failure, reported).
        ``fault``: the rank the generation's fault came from and the step it hit there, which that
        rank never completed and so never saves a later step: a save of one can never commit, and
        its part is said to be lost where the committing rank waits, so that it gives the save up
        now instead of at its commit timeout."""
        flight = self.ckpt.in_flight()
        origin, hit = fault if fault is not None else (-1, None)
        if flight is not None and origin >= 0 and hit is not None and flight[0] > hit:
            why = RuntimeError(f"its fault at step {hit} ended it before it saved step {flight[0]}")
            report_failure(self.ckpt.root, flight[0], self.ckpt.token, origin, why)
        try:
            self.ckpt.wait()
        except CheckpointError as e:
            self._failed(e, generation, step if step is not None else -1)

    def abandon_predecessor(self) -> None:
        """A replacement for a dead rank: the saves its predecessor had not finished never will be;
        say so where the committing rank waits, so that it gives them up now, not at its timeout."""
        if self.rank == 0:
            return
        for step, token, path in tmp_dirs(self.ckpt.root):
            if token == self.ckpt.token and not (path / part_name(self.rank)).exists():
                report_failure(
                    self.ckpt.root, step, token, self.rank, RuntimeError("the rank's process died")
                )

    def forget_unfinished(self, generation: int, step: int | None) -> None:
        """In a recovery, once every rank settled its save in flight: the steps the replay passes
        are saved afresh on every rank unless committed (``Checkpointer.forget_unfinished``)."""
        try:
            gone = self.ckpt.forget_unfinished()
        except CheckpointError as e:
            self._failed(e, generation, step if step is not None else -1)
            gone = self.ckpt.forget_unfinished()
        for path in gone:
            logger.info(f"rank {self.rank}: removed {path.name}: not committed before the recovery")

    def rebase(self, step: int) -> None:
        """Resumed at ``step`` (the same on every rank): the next save is counted from there, so
        a rank that saved a step its peers did not reach before the fault does not differ."""
        self.next_save = step + (self.cfg.interval if isinstance(self.cfg.interval, int) else 1)

    def due(self, nxt: int) -> bool:
        now = time.monotonic()
        if self._last_step_t is not None:
            dt = now - self._last_step_t
            self._step_s = dt if self._step_s is None else 0.9 * self._step_s + 0.1 * dt
        self._last_step_t = now
        return self.next_save is not None and nxt >= self.next_save

    def save(
        self, step: int, state: dict[str, Any], generation: int, faults_seen: int, pipeline: Any = ()
    ) -> None:
        """Save ``state`` as checkpoint ``step`` (the step waits for the copy only)."""
        behind = self.ckpt.in_flight()
        if behind is not None:  # the storage does not keep up with the interval: say so, with figures
            self.events.emit(
                Event.CHECKPOINT_SLOW,
                generation=generation,
                step=step,
                writing_step=behind[0],
                writing_s=behind[1],
                action=self.cfg.on_busy,  # wait: this step blocks until it is written; skip: no save
            )
        try:
            fut = self.ckpt.save(step, state, pipeline=pipeline if self.cfg.pipelined else ())
        except CheckpointError as e:
            self._failed(e, generation, step)
            fut = None
        else:
            if fut is not None:
                self._save_started[step] = time.monotonic()
                fut.add_done_callback(functools.partial(self._done, step))
        self._plan_next(step, faults_seen)
        if fut is not None:
            self.events.emit(
                Event.CHECKPOINT_SAVED,
                generation=generation,
                step=step,
                block_s=self.ckpt.last_block_s,
                next_step=self.next_save,
            )

    def _done(self, step: int, fut: Any) -> None:
        if fut.exception() is None:  # writer thread: only record the time here
            self._write_s = time.monotonic() - self._save_started.pop(step, time.monotonic())
            self.events.emit(
                Event.CHECKPOINT_DURABLE,
                generation=-1,
                step=step,
                write_s=self._write_s,
                nbytes=self.ckpt.last_nbytes,
                log=False,
            )
            if self.rank == 0 and self.cfg.flush_on_death and self.cfg.dir is not None:
                # (rank 0's save is done once committed) a flushed snapshot older is never restored
                with contextlib.suppress(OSError):
                    flushed.prune(flushed.root(self.cfg.dir), step)

    def _plan_next(self, step: int, faults_seen: int) -> None:
        if isinstance(self.cfg.interval, int):
            self.next_save = step + self.cfg.interval
            return
        # auto: rank 0 decides from its measurements, every rank adopts the same next step
        proposal = ""
        if self.rank == 0:
            write_s = self._write_s if self._write_s is not None else 1.0
            elapsed = time.monotonic() - self._t0
            mtbf = elapsed / faults_seen if faults_seen else max(self.cfg.mtbf_s, elapsed)
            tau = math.sqrt(2.0 * write_s * mtbf)
            step_s = self._step_s or 1.0
            proposal = json.dumps(step + max(1, round(tau / step_s)))
        chosen = self._agree(f"ckpt_next{step}", proposal, "first")
        self.next_save = int(json.loads(chosen))

    def _failed(self, e: CheckpointError, generation: int, step: int) -> None:
        self.failures += 1
        logger.error(f"rank {self.rank}: {e}; training continues, earlier checkpoints are intact")
        self.events.emit(Event.CHECKPOINT_FAILED, generation=generation, step=step, error=str(e))

    def final(self, step: int, state: dict[str, Any], generation: int) -> None:
        """The preemption checkpoint: wait for the save in flight, save, wait for the commit."""
        try:
            self.ckpt.wait()
        except CheckpointError as e:
            self._failed(e, generation, step)
        self.ckpt.save(step, state)
        self.ckpt.wait()
        self.events.emit(Event.CHECKPOINT_SAVED, generation=generation, step=step, final=True)

    def close(self, generation: int, step: int | None) -> None:
        """Flush at the end of the run; a failure of the last save is raised."""
        self.uninstall()
        try:
            self.ckpt.close()
        except CheckpointError as e:
            self._failed(e, generation, step or -1)
            raise
