"""The base of every validated configuration section: unknown keys refused, frozen, defaults
validated. :class:`resilient.config.Config` is made of such sections, and so is each detector's
own (``resilient.detectors``), which is why the base lives below both."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


def interval_or_auto(v: int | str) -> int | str:
    """A snapshot or digest interval: ``auto``, or at least 1 step."""
    if isinstance(v, int) and v < 1:
        raise ValueError("must be >= 1 or 'auto'")
    return v
