"""What a fault is, at the bottom of the runtime: its record, symptom and signature (``records``),
the stacks taken when one is seen, and how the run ends with one (``exits``)."""
