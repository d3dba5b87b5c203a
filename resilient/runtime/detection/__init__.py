"""How a rank learns that its step must end: a peer's fault heard from the store, a hang seen
by the monitor, the hard-hang timer; what a fault is (its record, symptom and signature)."""
