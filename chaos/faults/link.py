"""Faults of a real network link: the target rank runs in its own network namespace behind a veth
pair (chaos/netns.py), one per job; the harness takes the link down, or has netem drop packets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from chaos import netns
from chaos.faults.base import Arrangement, ByHarness

if TYPE_CHECKING:
    from chaos.runner import Runner
    from chaos.schedule import Planned


class LinkFault(ByHarness):
    needs: ClassVar[tuple[str, ...]] = ("root", "netns + veth (ip, nsenter, tc)")
    lasting = "link down"
    skip_label = "link faults"
    on_link = True
    lossy: ClassVar[bool] = False  # needs netem

    def arrange(self, setup: Arrangement, faults: Sequence[Planned]) -> str | None:
        why = netns.capability(loss=self.lossy)
        if why is not None:
            return why
        if setup.link is None:  # every link fault of the job cuts the same link (one rank behind it)
            setup.link = netns.VethLink.create(faults[0].rank)
            setup.stack.callback(setup.link.remove)
        return None

    def by_harness(self, run: Runner, f: Planned, done: int, pid: int) -> float | None:
        link = run.arrangement.link
        assert link is not None, "a link fault needs the job started behind a VethLink"
        extra = self._extra(f)
        run.record(self.name, f.rank, done + 1, pid=pid, duration_s=f.duration, **extra)
        self.cut(link, f)
        try:
            return run.lasts(f.duration)
        finally:
            self.restore(link)

    def _extra(self, f: Planned) -> dict[str, float]:
        return {}

    def cut(self, link: netns.VethLink, f: Planned) -> None:
        raise NotImplementedError

    def restore(self, link: netns.VethLink) -> None:
        raise NotImplementedError


class LinkDrop(LinkFault):
    name = "link_drop"
    summary = "the rank runs behind its own veth link; the link goes down for `duration` s"

    def cut(self, link: netns.VethLink, f: Planned) -> None:
        link.down()

    def restore(self, link: netns.VethLink) -> None:
        link.up()


class LinkLoss(LinkFault):
    name = "link_loss"
    summary = "netem drops `arg` % of the rank's packets for `duration` s"
    needs = (*LinkFault.needs, "netem (sch_netem)")
    arg = "% of packets dropped"
    default_arg = 30.0
    streams = False
    lossy = True

    def check_arg(self, arg: float | None) -> str | None:
        return None if arg and 0 < arg <= 100 else "link_loss needs the % of packets dropped (0-100]"

    def _extra(self, f: Planned) -> dict[str, float]:
        return {"loss_pct": self._pct(f)}

    def _pct(self, f: Planned) -> float:
        return f.arg if f.arg is not None else self.default_arg or 0.0

    def cut(self, link: netns.VethLink, f: Planned) -> None:
        link.loss(self._pct(f))

    def restore(self, link: netns.VethLink) -> None:
        link.loss(0)
