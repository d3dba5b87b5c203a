"""What an operator sees: goodput accounting by cause, fault reports, Prometheus metrics, live status."""

from resilient.metrics.accounting import CAUSES, OTHER, Accounting, Incident, account

__all__ = ["CAUSES", "OTHER", "Accounting", "Incident", "account"]
