"""What ``resilient launch --fault PLAN`` loads (entry point group ``resilient.fault_plans``): the
environment that has a plain launch's workers fire the plan's faults, the way a certificate's jobs
do (chaos/hooks.py's step hook, named in ``RESILIENT_HOOKS``). The launcher never imports the
harness: it finds this through the entry point, and a plan is refused here, before any worker
starts, when it does not parse."""

from __future__ import annotations

from collections.abc import Mapping

from chaos.hooks import FACTORY, Var
from chaos.inject import Injector
from resilient.launch_env import Var as LaunchVar


def plan_env(plan: str, injections: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to the workers' environment (``environ``: theirs so far) so that
    ``plan`` fires, each fault once per job (``injections``: the file where the job's processes
    record what fired, so a relaunched or replacement worker does not fire it again). Raises
    ``ValueError`` naming the part of ``plan`` that does not parse, and the kinds it may name."""
    Injector.parse(plan)
    named = [h.strip() for h in environ.get(LaunchVar.HOOKS.value, "").split(",") if h.strip()]
    return {
        Var.PLAN.value: plan,
        Var.INJECTIONS.value: injections,
        LaunchVar.HOOKS.value: ",".join(dict.fromkeys([*named, FACTORY])),
    }
