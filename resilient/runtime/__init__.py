"""The in-process runtime (internal; the public API is re-exported from ``resilient``)."""
