"""chaos: real fault injection for resilient (injectors keyed by rank and step)."""

from chaos.inject import KINDS, Fault, InjectedFault, Injector

__all__ = ["KINDS", "Fault", "InjectedFault", "Injector"]
