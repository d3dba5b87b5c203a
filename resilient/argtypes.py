"""Argument types for every command line: a bad value is a usage error naming the flag and the
value (argparse: exit 2), never a traceback from deeper in."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return v


def positive(text: str) -> float:
    v = number(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return v


def nonnegative(text: str) -> float:
    v = number(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return v


def count(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}: {text}")
        return v

    return parse
