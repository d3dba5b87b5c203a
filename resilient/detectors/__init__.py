"""Detectors: the checks that turn a silent fault (a NaN about to reach the weights, replicas
that differ, a skipped collective, a slow rank) into one the runtime recovers from."""
