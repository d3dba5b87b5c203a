"""resilient: keep PyTorch distributed training alive through everyday cluster faults."""

import warnings

# nvidia-resiliency-ext pulls in the deprecated `pynvml` shim, which warns when torch.cuda imports it;
# we depend on nvidia-ml-py (same import name), so the warning is noise for our users.
PYNVML_NOISE = "The pynvml package is deprecated"
warnings.filterwarnings("ignore", message=PYNVML_NOISE, category=FutureWarning)

from resilient.checkpoint import Checkpointer, Loaded, OnBusy, ShmSnapshot
from resilient.config import Config, Timeouts, load_config
from resilient.errors import (
    CheckpointError,
    ConfigError,
    CoordinationError,
    ExitCode,
    FaultRepeats,
    HardFault,
    HealthCheckFailed,
    PeerAborted,
    Preempted,
    ReplayDiverged,
    ResilienceError,
    RestartBudgetExhausted,
    StateRestoreError,
    StepInterrupted,
)
from resilient.events import Event, read_events, read_run_events
from resilient.health import CheckResult, HealthInput
from resilient.runtime.context import Context
from resilient.runtime.hooks import Hook, RunInfo, StepHook
from resilient.runtime.wrapper import current, wrap
from resilient.state.carry import Carried

__version__ = "0.1.0"

__all__ = [
    "Carried",
    "CheckResult",
    "CheckpointError",
    "Checkpointer",
    "Config",
    "ConfigError",
    "Context",
    "CoordinationError",
    "Event",
    "ExitCode",
    "FaultRepeats",
    "HardFault",
    "HealthCheckFailed",
    "HealthInput",
    "Hook",
    "Loaded",
    "OnBusy",
    "PeerAborted",
    "Preempted",
    "ReplayDiverged",
    "ResilienceError",
    "RestartBudgetExhausted",
    "RunInfo",
    "ShmSnapshot",
    "StateRestoreError",
    "StepHook",
    "StepInterrupted",
    "Timeouts",
    "__version__",
    "current",
    "load_config",
    "read_events",
    "read_run_events",
    "wrap",
]
