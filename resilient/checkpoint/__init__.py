"""Checkpointing: local and persistent tiers, manifests, and background upload."""
