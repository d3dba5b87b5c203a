"""How a rank leaves its step: a peer's fault heard from the store, a hang seen by the monitor,
the hard-hang timer; every source ends in the same place (``notice.Notice.leave``)."""
