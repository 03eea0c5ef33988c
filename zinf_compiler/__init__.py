"""zinf: ZeRO-Infinity as a torch.compile backend.

``torch.compile(model, backend="zinf", options={...})`` works without
importing this package (the backend is registered through the
``torch_dynamo_backends`` entry point); import it for the helpers.
"""

from . import optim
from .api import full_state_dict, gathered, memory_report, reset_peak_memory
from .backend import materialize, register, zinf_backend
from .checkpoint import ZinfCheckpointError, export, latest, load, save
from .deepspeed_config import DeepSpeedConfigWarning, options_from_deepspeed
from .options import ZinfOptionError, ZinfOptions, describe_options, parse_options
from .budget import BudgetError, plan
from .planner import Prediction

__version__ = "0.1.0"

__all__ = [
    "BudgetError",
    "ZinfCheckpointError",
    "DeepSpeedConfigWarning",
    "options_from_deepspeed",
    "export",
    "latest",
    "load",
    "save",
    "full_state_dict",
    "gathered",
    "materialize",
    "memory_report",
    "plan",
    "Prediction",
    "optim",
    "reset_peak_memory",
    "ZinfOptionError",
    "ZinfOptions",
    "describe_options",
    "parse_options",
    "register",
    "zinf_backend",
]
