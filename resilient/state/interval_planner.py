"""Checkpoint-interval planning: Young's and Daly's optimal intervals, expected goodput, and a
Monte-Carlo simulation of the run that checks the closed form.

Model (Daly 2006): failures are a Poisson process with mean time between failures ``M``; the run
alternates compute segments of length ``tau`` with checkpoint writes of length ``delta``; a failure
loses the segment in progress and costs a restart of length ``R`` (during which failures can also
strike). The expected wall time per unit of useful work is

    wall / work = M · e^(R/M) · (e^((tau+delta)/M) − 1) / tau

so goodput = tau / (M · e^(R/M) · (e^((tau+delta)/M) − 1)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def young(delta: float, mtbf: float) -> float:
    """Young (1974): tau = sqrt(2 · delta · M)."""
    return math.sqrt(2.0 * delta * mtbf)


def daly(delta: float, mtbf: float) -> float:
    """Daly (2006) higher-order optimum: for delta < 2M,
    tau = sqrt(2δM) · [1 + ⅓·sqrt(δ/2M) + (δ/2M)/9] − δ, else M."""
    if delta >= 2.0 * mtbf:
        return mtbf
    x = delta / (2.0 * mtbf)
    return math.sqrt(2.0 * delta * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def goodput(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Expected fraction of wall time spent on useful compute (closed form above)."""
    if tau <= 0:
        raise ValueError(f"interval must be > 0, got {tau}")
    return tau / (mtbf * math.exp(restart / mtbf) * math.expm1((tau + delta) / mtbf))


@dataclass(frozen=True)
class Simulation:
    goodput: float
    failures: int
    segments: int


def simulate(
    tau: float, delta: float, restart: float, mtbf: float, segments: int = 20_000, seed: int = 0
) -> Simulation:
    """Run ``segments`` checkpointed segments through Poisson failures; measure the goodput."""
    rng = np.random.default_rng(seed)
    wall = 0.0
    failures = 0
    need = tau + delta
    for _ in range(segments):
        while True:
            t = rng.exponential(mtbf)  # time to the next failure from now
            if t >= need:
                wall += need
                break
            wall += t  # the segment in progress is lost
            failures += 1
            while True:  # restart; a failure during the restart starts it over
                t = rng.exponential(mtbf)
                if t >= restart:
                    wall += restart
                    break
                wall += t
                failures += 1
    return Simulation(goodput=segments * tau / wall, failures=failures, segments=segments)


def mtbf_from_gpus(gpus: int, gpu_mtbf_h: float) -> float:
    """Job MTBF in seconds when any of ``gpus`` independent GPUs failing stops the job."""
    if gpus < 1 or gpu_mtbf_h <= 0:
        raise ValueError("gpus must be >= 1 and gpu_mtbf_h > 0")
    return gpu_mtbf_h * 3600.0 / gpus
