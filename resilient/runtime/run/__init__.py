"""What a run and each of its generations hold: the session (identity, namespace, event log,
health checks), the wiring a run gets from outside (store, group builder), one generation's
state, and the snapshot schedule."""
