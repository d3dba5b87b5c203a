"""What every rank does between a failed generation and the next, and the restart policy that
bounds it."""
