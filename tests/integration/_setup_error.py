"""A user script that fails before its first step, in one of several ways (argv[1]), on one rank
(argv[2], or every rank with -1); argv[3], optional: the engine."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import resilient

HOW, WHO = sys.argv[1], int(sys.argv[2])
ENGINE = sys.argv[3] if len(sys.argv) > 3 else "resilient"


@resilient.wrap(hang_timeout=10, engine=ENGINE)
def train(ctx):
    culprit = WHO in (-1, ctx.rank)
    if culprit and HOW == "import":
        import not_a_module_of_this_project  # noqa: F401
    model = torch.nn.Linear(4, 4)
    if culprit and HOW == "track":
        ctx.track(model=model, data=[1, 2, 3])
    else:
        ctx.track(model=model)
    total = -1 if culprit and HOW == "steps" else 5
    for _ in ctx.steps(total):
        t = torch.ones(1)
        dist.all_reduce(t)


if __name__ == "__main__":
    train()
