"""Compile, train and drop a model five times in one process; run as a subprocess by test_leak.py.

Prints one JSON object: per round the store's live records, resting and
transient bytes, swap-file bytes and files, the resident set, and the
model's state bytes (from memory_report before the drop).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from zinf_compiler.runtime.host_memory import trim
from zinf_compiler.api import RUNTIME

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def main() -> None:
    tier, nvme_path, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=384)
    options = {"stage": 3, "offload_param": tier, "offload_optimizer": tier, "lower": "eager",
               "nvme_path": nvme_path}
    result = []
    for round_index in range(rounds):
        torch.manual_seed(round_index)
        model = GPT(cfg)
        compiled = torch.compile(model, backend="zinf", options=options)
        opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
        for idx, targets in synthetic_batches(cfg, 2, 2, seed=round_index):
            compiled(idx, targets).backward()
            opt.step()
            opt.zero_grad()
        compiled(idx, targets).backward()  # gradients held at the drop, too
        report = zinf.memory_report(model)
        state_bytes = sum(sum(report[t].values()) for t in ("device", "cpu", "nvme"))
        del model, compiled, opt, report
        torch._dynamo.reset()
        gc.collect()
        RUNTIME.store.collect()  # what every zinf entry point does first
        trim()
        swap_files = sum(len(os.listdir(engine.folder)) for engine in RUNTIME.store.engines())
        result.append({
            "records": len(RUNTIME.store.records()), "resting": dict(RUNTIME.store.resting), "transient": dict(RUNTIME.store.transient),
            "pinned_pool": RUNTIME.store.pinned.capacity_bytes if RUNTIME.store.pinned is not None else 0,
            "swap_bytes": sum(engine.bytes_on_disk() for engine in RUNTIME.store.engines()), "swap_files": swap_files,
            "rss": rss(), "state_bytes": state_bytes})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
