"""What torch imports lazily the first time a script builds a model and steps an optimizer.

``torch._dynamo``, sympy and mpmath among them: ~800 modules, ~120k Python objects, most of a
fresh worker's first second. Paid where it does not count: before the engine's ``gc.freeze()``
(else every full collection after a fault scans them all: ~0.1 s of each recovery), and in a
standby before it waits (else after its promotion).
"""

from __future__ import annotations

import torch


def first_use_imports() -> None:
    """Build a tiny model and step two optimizers once, on the CPU; the torch RNG comes back as
    it was (the script's random stream must be the one it would have had)."""
    rng = torch.get_rng_state()
    try:
        m = torch.nn.Sequential(torch.nn.Embedding(8, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        for opt in (torch.optim.AdamW(m.parameters()), torch.optim.SGD(m.parameters(), lr=0.1)):
            m(torch.zeros(1, 2, dtype=torch.long)).sum().backward()
            opt.step()
            opt.zero_grad()
    except Exception:  # warming is an optimisation; the script runs either way
        pass
    finally:
        torch.set_rng_state(rng)
