"""Measure zinf's per-tier accounting against the OS; run as a subprocess by test_accounting.py.

Each transition that changes what the runtime holds (model built into its
shards, gradients produced, optimizer moments created, gradients dropped) is
measured twice: by ``memory_report`` and by the OS (resident set from
/proc/self/statm for the cpu tier, swap-file blocks on disk for the nvme
tier).  Prints one JSON object: {transition: {"report": bytes, "os": bytes}}.

The parent sets MALLOC_MMAP_THRESHOLD_ so glibc serves these allocations
with mmap and gives freed memory straight back: otherwise freed gradients
stay in the heap and the resident set cannot shrink when zinf frees them.
"""

from __future__ import annotations

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


def anonymous_rss() -> int:
    """The resident set less its file-backed and shared pages: the memory tensors live in.  Code pages of
    the shared libraries count in rss() when first touched, or touched again after the kernel reclaimed
    them on a busy machine; they are no working memory of zinf's."""
    with open("/proc/self/statm") as statm:
        fields = statm.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


def tier_total(report: dict, tier: str) -> int:
    return sum(report[tier].values())


def main() -> None:
    tier, nvme_path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=8192, block_size=32, n_layer=4, n_head=8, n_embd=512)
    options = {"stage": 3, "offload_param": tier, "offload_optimizer": tier, "lower": "eager"}
    if tier == "nvme":
        options.update(nvme_path=nvme_path, nvme_copies=1, nvme_grad_ram_bytes=0)  # gradients on disk too
    with torch.device("meta"):
        model = GPT(cfg)
    result = {}

    def measure(name: str, action) -> None:
        trim()  # start from a heap holding no free pages (the optimizer step trims at its end)
        before_report, before_rss = zinf.memory_report(model), rss()
        before_disk = sum(e.bytes_on_disk() for e in RUNTIME.store.engines())
        action()
        RUNTIME.store.finish_grad_writes()  # the report counts gradients being written as on disk already
        trim()  # free pages glibc kept from the action's temporaries are not held by anyone
        after_report, after_rss = zinf.memory_report(model), rss()
        after_disk = sum(e.bytes_on_disk() for e in RUNTIME.store.engines())
        result[name] = {
            "report_cpu": tier_total(after_report, "cpu") - tier_total(before_report, "cpu")
            + after_report["buffers"]["cpu"] - before_report["buffers"]["cpu"],
            "rss": after_rss - before_rss,
            "report_nvme": tier_total(after_report, "nvme") - tier_total(before_report, "nvme"),
            "disk": after_disk - before_disk,
        }

    torch.manual_seed(0)
    measure("materialize", lambda: zinf.materialize(model, options, init_fn=model.init_weights, progress=False))
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
    batches = synthetic_batches(cfg, 2, 3)
    # Compile and warm up once: what compilation keeps is not state.
    compiled(*batches[0]).backward()
    opt.zero_grad()
    measure("backward", lambda: compiled(*batches[1]).backward())
    measure("first_step", opt.step)
    measure("zero_grad", opt.zero_grad)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
