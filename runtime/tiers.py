"""The tier vocabulary: where a parameter's state rests, shared by the compile side and the runtime.

Options name a tier as the user offloads to it (``offload_param`` /
``offload_optimizer`` = "none" | "cpu" | "nvme"); the store, the layouts the
passes read and ``memory_report`` name where the state rests: "device" |
"cpu" | "nvme".  :func:`store_tier` is the one translation between the two,
applied once, when a parameter is adopted (zinf_compiler/adoption.py); from
then on its layout's ``param_tier`` / ``opt_tier`` is the decision every
layer reads.
"""

import torch

DEVICE, CPU, NVME = "device", "cpu", "nvme"
TIERS = (DEVICE, CPU, NVME)  # where state rests, in memory_report's order
KINDS = ("params", "grads", "optimizer", "activations")  # what memory_report counts on each tier


def store_tier(offload: str) -> str:
    """Where state rests when offloaded to ``offload`` (an option value: "none", "cpu" or "nvme")."""
    return {"none": DEVICE, "cpu": CPU, "nvme": NVME}[offload]


def fetch_steps(tier: str, compute_device) -> tuple[str, ...]:
    """The steps that bring a shard resting on ``tier`` to a gather on ``compute_device``, in order.

    "nc": NVMe into a pinned CPU buffer; "cg": CPU memory to the device.  None for a shard resting where
    the gather reads it: the device tier, or the cpu tier when the compute device is the CPU itself.  The
    offload pass inserts these steps and the store expects them (a unit with no steps is gathered from
    its resting shards).
    """
    if tier == NVME:
        return ("nc", "cg")
    if tier == CPU and torch.device(compute_device).type != "cpu":
        return ("cg",)
    return ()
