"""The tier vocabulary: where a parameter's state rests, shared by the compile side and the runtime.

Options name a tier as the user offloads to it (``offload_param`` /
``offload_optimizer`` = "none" | "cpu" | "nvme"); the store, the layouts the
passes read and ``memory_report`` name where the state rests: "device" |
"cpu" | "nvme".  :data:`STORE_TIER` is the one translation between the two,
made once when the options are parsed into a parameter's settings.
"""

DEVICE, CPU, NVME = "device", "cpu", "nvme"
TIERS = (DEVICE, CPU, NVME)  # where state rests, in memory_report's order
STORE_TIER = {"none": DEVICE, "cpu": CPU, "nvme": NVME}  # option value -> where the state rests
