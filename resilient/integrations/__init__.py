"""Where users already train: the trainers whose loop is theirs, made resilient in one line.

- :mod:`resilient.integrations.lightning`: PyTorch Lightning's ``Trainer`` (``resilient[lightning]``).
- :mod:`resilient.integrations.hf`: the Hugging Face ``Trainer`` and objects from Accelerate's
  ``accelerator.prepare`` (``resilient[hf]``).

Each is imported on its own (``import resilient`` does not import Lightning or transformers).
"""
