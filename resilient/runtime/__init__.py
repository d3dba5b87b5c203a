"""The in-process runtime (internal; the public API is re-exported from ``resilient``).

Its rooms, top down (docs/architecture.md draws them): the front door (``wrapper``, ``context``,
``hooks``, ``standby``); ``engine/`` (an engine runs the function once per generation);
``steps/`` (the step loop both engines share); ``detection/`` (how a rank learns its step must
end); ``recovery/`` (what happens between two generations); ``keeping/`` (where state goes besides
the ring, and where a new process takes it from); ``coordination/`` (the store protocol, node
stores, process groups). The detectors of silent faults are a room of their own below the
configuration (``resilient.detectors``).
"""

# The recovery path's version: bumped when a change to detection, recovery or restore moves what
# a fault costs. Every result under benchmarks/results is stamped with it (chaos.results), and the
# figures the docs quote must come from a result of the current one (chaos.figures).
RECOVERY_PATH = 1
