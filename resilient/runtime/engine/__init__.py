"""Engines: what runs the training function once per generation (``engine: resilient``, the
built-in one, or ``engine: nvrx``), the run's session, the wiring a run gets from outside."""
