"""A new process in one dead rank's place, its survivors left running (``--replace rank``).

The agent decides (:mod:`resilient.launcher.policy`); this does it. It kills what the dead worker
left in its session, posts the death to the job's store as the fault of the generation the worker
was in (its heartbeat says which), so that the survivors' listeners wake at once and recover in
their own processes, then starts one process with the dead rank's identity, a warm standby if one
waits (:mod:`resilient.launcher.standby`), and has the backend (torch elastic) monitor that one
from now on. The new process restores the rank's snapshot from this node's shared memory and joins
the survivors' recovery. Everything it does to a worker goes through the
:class:`~resilient.launcher.backend.WorkerBackend`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

from resilient.contract import Beat, beat_path, death_record, publish_fault, read_beat, run_namespace
from resilient.events import Event
from resilient.launch_env import Var
from resilient.launcher.backend import Process, WorkerBackend
from resilient.launcher.standby import RANK_VARS, Standby, target

STANDBY_DELAY_S = 2.0


class Replacer:
    """Replaces dead ranks' processes and keeps ``standby`` warm standbys waiting for that."""

    def __init__(
        self,
        backend: WorkerBackend,
        heartbeat_dir: Path,
        emit: Callable[..., None],
        standby: int,
        park: bool = True,
        budgets: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.backend = backend
        self.budgets = budgets  # the launcher's budgets left, for the rank_replaced event
        self.heartbeat_dir = heartbeat_dir
        self.standby_count = standby
        self.park = park  # standbys run the script up to its resilient.wrap (standby.py)
        self._emit = emit
        self._standbys: list[Standby] = []
        self._store_client: Any = None  # the workers' store, where a death is posted as a fault
        self._spare_deaths = 0  # a spare node's standbys that died before they were ready

    def replace(self, local_rank: int, beat: Beat, cause: str) -> int:
        """A new process for ``local_rank`` that joins the survivors in ``beat.generation``;
        returns its pid."""
        worker = next(w for w in self.backend.workers() if w.local_rank == local_rank)
        old_pid = worker.pid
        self.backend.kill(local_rank)  # what it left in its session (loader workers)
        t0 = time.time()
        env = {
            **self.backend.invocation(local_rank).env,
            Var.JOIN_GENERATION.value: str(beat.generation),
            Var.PREDECESSOR_PID.value: str(old_pid),
        }
        posted = self._post_death(env, worker.global_rank, beat, cause)
        beat_path(self.heartbeat_dir, local_rank).unlink(missing_ok=True)
        # The dead process may still be tearing down (one SIGKILLed just now after a missed
        # heartbeat frees its memory first): its replacement starts meanwhile, and a replacement
        # that needs what it holds (a GPU's memory) waits for its exit itself.
        new, warm = self._spawn(local_rank, env)
        self.backend.adopt(local_rank, new)
        self._emit(
            Event.RANK_REPLACED,
            global_rank=worker.global_rank,
            local_rank=local_rank,
            old_pid=old_pid,
            new_pid=new.proc.pid,
            standby=warm,
            join_generation=beat.generation,
            last_step=beat.step,
            fault_posted=posted,
            duration_s=time.time() - t0,
            cause=cause,
            **self.budgets(),
        )
        logger.info(
            f"rank {worker.global_rank} replaced by pid {new.proc.pid} "
            f"({'warm standby' if warm else 'new process'}); "
            f"survivors stay in generation {beat.generation}"
        )
        return int(new.proc.pid)

    def _post_death(self, env: dict[str, str], global_rank: int, beat: Beat, cause: str) -> bool:
        """The dead rank's fault in the workers' store: its survivors' listeners wake at once."""
        try:
            if self._store_client is None:
                self._store_client = self.backend.connect_store()
            run_id = os.environ.get(Var.RUN_ID.value) or env.get(Var.ELASTIC_RUN_ID.value, "")
            attempt = os.environ.get(Var.LAUNCH_ROUND.value) or env.get(Var.RESTART_COUNT.value, "0")
            namespace = run_namespace(run_id, attempt)
            raw = death_record(global_rank, beat.generation, beat.step, cause)
            publish_fault(self._store_client, namespace, beat.generation, global_rank, raw)
            return True
        except Exception as e:  # the survivors still notice: their collectives with it fail
            logger.warning(f"could not post rank {global_rank}'s death to the store: {e}")
            self._store_client = None
            return False

    def _spawn(self, local_rank: int, env: dict[str, str]) -> tuple[Process, bool]:
        """A process for ``local_rank`` with ``env``: a promoted standby if one waits, else a new one."""
        how = self.backend.invocation(local_rank)
        sb = self.promote(local_rank, env, how.entrypoint, how.args, how.stdout, how.stderr)
        if sb is not None:
            return sb, True
        return self.backend.spawn(local_rank, env), False

    def promote(
        self,
        local_rank: int,
        env: dict[str, str],
        entrypoint: str,
        args: tuple[str, ...],
        stdout: str | None,
        stderr: str | None,
    ) -> Standby | None:
        """A waiting standby made ``local_rank``'s worker started as ``entrypoint *args`` with
        ``env``; None when none waits that can."""
        tgt = target(entrypoint, args)
        for sb in [s for s in self._standbys if tgt is not None and s.alive() and s.takes(tgt)]:
            self._standbys.remove(sb)
            assert tgt is not None
            try:
                sb.promote(local_rank, {**os.environ, **env}, tgt, stdout, stderr)
            except OSError as e:  # it died meanwhile (its order pipe is closed): the next, or a new one
                logger.warning(f"standby {sb.proc.pid} could not be promoted ({e}): not used")
                sb.close()
                continue
            return sb
        return None

    def keep_spare_standbys(self, count: int, entrypoint: str, args: tuple[str, ...]) -> None:
        """A spare node (no workers yet) keeps ``count`` standbys parked in the script it would
        run (``entrypoint *args``), to take a lost node's ranks."""
        for sb in [s for s in self._standbys if not s.alive()]:
            self._spare_deaths += 0 if sb.ready() else 1  # (died before it was ready)
            sb.close()
        self._standbys = [s for s in self._standbys if s.alive()]
        self._announce()
        if self._spare_deaths >= 3:  # the script cannot park here: the seat's ranks start cold
            if self._spare_deaths == 3:
                self._spare_deaths += 1
                logger.warning("a spare's standbys died before they were ready 3 times: none are kept")
            return
        park = target(entrypoint, args) if self.park else None
        hide = tuple(sorted(RANK_VARS | {k for k in os.environ if k.startswith("TORCHELASTIC_")}))
        self.heartbeat_dir.mkdir(parents=True, exist_ok=True)  # (their ready marks; no worker made it)
        while len(self._standbys) < count:
            self._standbys.append(Standby(dict(os.environ), self.heartbeat_dir, park, hide))

    def keep_standbys(self, newest_start: float) -> None:
        """Start a standby when fewer than asked wait, once every worker is stepping and the
        newest has been for ``STANDBY_DELAY_S`` (a standby's imports would compete with a starting
        worker's, or slow a replacement's first steps on a node with few cores)."""
        for sb in self._standbys:
            why = sb.fallback() if not sb.fallback_seen else None
            if why is not None:
                sb.fallback_seen = True
                # the same script would fail the next standby alike: from now on they import only
                self.park = False
                logger.warning(f"standby {sb.proc.pid} cannot wait in the script (it imports only): {why}")
                self._emit(Event.STANDBY_FALLBACK, standby_pid=sb.proc.pid, reason=why)
        for sb in [s for s in self._standbys if not s.alive()]:
            sb.close()  # (its ready and fallback files)
        self._standbys = [s for s in self._standbys if s.alive()]
        self._announce()
        if len(self._standbys) >= self.standby_count:
            return
        if time.monotonic() - newest_start < STANDBY_DELAY_S:
            return
        for w in self.backend.workers():
            beat = read_beat(beat_path(self.heartbeat_dir, w.local_rank))
            if beat is None or beat.step < 0 or beat.exiting:  # (starting, or the run is over)
                return
        how = self.backend.invocation(0)
        park = target(how.entrypoint, how.args) if self.park else None
        self._standbys.append(Standby({**os.environ, **how.env}, self.heartbeat_dir, park, self._rank_vars()))

    def _announce(self) -> None:
        """A ``standby_ready`` event for each standby that became ready since the last look."""
        for sb in self._standbys:
            if not sb.announced and sb.ready():
                sb.announced = True
                self._emit(
                    Event.STANDBY_READY,
                    standby_pid=sb.proc.pid,
                    standbys=len(self._standbys),
                    warmth=sb.warmth(),
                )

    def ready(self) -> int:
        """How many standbys wait ready."""
        return sum(1 for s in self._standbys if s.alive() and s.ready())

    def _rank_vars(self) -> tuple[str, ...]:
        """The worker variables a parking standby's script must not see: a worker's identity, the
        job's size and store, and any that differs between this node's workers."""
        envs = [self.backend.invocation(w.local_rank).env for w in self.backend.workers()]
        differ = {k for k in envs[0] if len({e.get(k) for e in envs}) > 1}
        return tuple(sorted(differ | {k for k in envs[0] if k in RANK_VARS or k.startswith("TORCHELASTIC_")}))

    def close(self) -> None:
        """Stop the standbys that wait (they exit when their stdin closes, or by SIGTERM)."""
        for s in self._standbys:
            s.close()
        for s in self._standbys:
            with contextlib.suppress(Exception):
                s.proc.wait(timeout=10)
        self._standbys = []
