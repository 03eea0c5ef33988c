"""Materialize a GPT from a safetensors folder and export it again, measuring peak RSS of each (one process).

Run by tests/integration/test_export.py as ``python tests/workers/weights_worker.py ARGS_JSON``;
prints one JSON line: the RSS peaks over each call's own window
(``/proc/self/clear_refs`` resets the high-water mark).
"""

import json
import sys

import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig
from zinf_compiler.runtime.host_memory import new_peak_window, rss_figures as rss


def main() -> None:
    args = json.loads(sys.argv[1])
    options = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme", "nvme_path": args["nvme_path"], "pinned_bytes": args["pinned_bytes"],
               "lower": "eager"}
    with torch.device("meta"):
        model = GPT(GPTConfig(**args["config"]))
    before = new_peak_window()
    zinf.materialize(model, options, weights=args["weights"], progress=False)
    materialize_peak = rss()["VmHWM"] - before
    zinf.optim.AdamW(model.parameters())  # a model as it is trained: its optimizer exists too
    before = new_peak_window()
    zinf.export(args["export"], model)
    export_peak = rss()["VmHWM"] - before
    print(json.dumps({"materialize_peak": materialize_peak, "export_peak": export_peak}))


if __name__ == "__main__":
    main()
