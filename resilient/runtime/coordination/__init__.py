"""The ranks' protocol on the job's store (faults, barriers, agreements), node stores, and the
process group of each generation."""
