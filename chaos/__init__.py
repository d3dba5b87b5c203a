"""chaos: real fault injection for resilient (injectors keyed by rank and step)."""

import resilient  # noqa: F401  # first: it silences the pynvml shim's warning before torch loads
from chaos.compare import assert_bit_exact
from chaos.inject import KINDS, Fault, InjectedFault, Injector, append_line

__all__ = ["KINDS", "Fault", "InjectedFault", "Injector", "append_line", "assert_bit_exact"]
