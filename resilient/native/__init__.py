"""Native parts of the runtime: small C pieces where Python cannot reach (names.py says why)."""
