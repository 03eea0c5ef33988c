"""Materialize a GPT from a safetensors folder and export it again, measuring peak RSS of each (one process).

Run by tests/test_export.py as ``python tests/weights_worker.py ARGS_JSON``;
prints one JSON line: the RSS peaks over each call's own window
(``/proc/self/clear_refs`` resets the high-water mark).
"""

import json
import sys

import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig


def rss() -> dict[str, int]:
    figures = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                figures[line.split(":")[0]] = int(line.split()[1]) * 1024
    return figures


def new_window() -> int:
    """Reset the peak RSS to the current RSS; returns it."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return rss()["VmRSS"]


def main() -> None:
    args = json.loads(sys.argv[1])
    options = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": args["nvme_path"], "pinned_bytes": args["pinned_bytes"],
               "lower": "eager"}
    with torch.device("meta"):
        model = GPT(GPTConfig(**args["config"]))
    before = new_window()
    zinf.materialize(model, options, weights=args["weights"], progress=False)
    materialize_peak = rss()["VmHWM"] - before
    zinf.optim.AdamW(model.parameters())  # a model as it is trained: its optimizer exists too
    before = new_window()
    zinf.export(args["export"], model)
    export_peak = rss()["VmHWM"] - before
    print(json.dumps({"materialize_peak": materialize_peak, "export_peak": export_peak}))


if __name__ == "__main__":
    main()
