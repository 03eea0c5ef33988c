"""Working memory of one oversized MLP, untiled or tiled; run as a subprocess by test_tile_memory.py.

After a warm-up step (optimizer state and gradient shards exist), one
forward and backward run with every change of the runtime's accounting
sampled together with the anonymous resident set (/proc/self/statm's
resident less shared: no library code pages), right where the runtime books
it.  Prints one JSON object: the peak gathered and in-flight
device bytes (``peak_transient_device``), the growth of the accounted bytes
and of the resident set over the baseline, the bytes read from NVMe (with a
third argument, the parameters live on NVMe under that folder) and the tile
layout.

The parent sets MALLOC_MMAP_THRESHOLD_ so that every tensor of 64 KiB or
more is its own mapping: freed tensors leave the resident set at once.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn

import zinf_compiler as zinf
from zinf_compiler.runtime.host_memory import trim
from zinf_compiler.api import RUNTIME
from accounting_worker import anonymous_rss, rss


def accounted() -> int:
    return sum(RUNTIME.store.resting.values()) + sum(RUNTIME.store.transient.values())


def main() -> None:
    hidden, factor = int(sys.argv[1]), int(sys.argv[2])
    nvme_path = sys.argv[3] if len(sys.argv) > 3 else None
    torch.set_num_threads(1)
    # One core: torch's one thread then fills it, so the copy engine copies at once on this thread
    # (CopyEngine.cores_busy) instead of on its worker.  On the worker, how much of the next gather
    # is resident when the resident set is sampled depends on the thread timing (a loaded machine
    # sampled a half-copied weight, stop 49's CI); inline, it is all there from its gather_start on.
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
    weight_bytes = 4 * hidden * hidden * 4
    options = {"stage": 3, "lower": "eager", "offload_param": "cpu", "tile_factor": factor,
               "tile_threshold": weight_bytes - 1 if factor > 1 else 2 * weight_bytes}
    if nvme_path:
        options.update(offload_param="nvme", nvme_path=nvme_path, nvme_copies=1)
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, hidden)

    def train_step() -> None:
        compiled(x).square().mean().backward()

    train_step()
    opt.step()
    # No zero_grad: the measured backward accumulates into the gradient shards
    # that exist already, so what grows is the working memory alone.
    trim()
    RUNTIME.store.reset_peak()
    baseline_rss, baseline_resident, baseline_accounted = anonymous_rss(), rss(), accounted()
    samples = []
    book_transient, book_resting = RUNTIME.store._add_transient, RUNTIME.store._add_resting

    def sampled(book):
        def wrapper(*args, **kwargs):
            result = book(*args, **kwargs)
            samples.append((accounted(), anonymous_rss(), rss()))
            return result

        return wrapper

    RUNTIME.store._add_transient, RUNTIME.store._add_resting = sampled(book_transient), sampled(book_resting)
    read_before = sum(engine.bytes_read for engine in RUNTIME.store.engines())
    try:
        train_step()
    finally:
        RUNTIME.store._add_transient, RUNTIME.store._add_resting = book_transient, book_resting
    print(json.dumps({
        "peak_transient_device": RUNTIME.store.peak_transient["device"],
        "accounted_growth": max(sample[0] for sample in samples) - baseline_accounted,
        "rss_growth": max(sample[1] for sample in samples) - baseline_rss,
        # Told apart for the record: the whole resident set's growth, library code pages included.
        "resident_growth": max(sample[2] for sample in samples) - baseline_resident,
        "weight_bytes": weight_bytes,
        "bytes_read": sum(engine.bytes_read for engine in RUNTIME.store.engines()) - read_before,
        "tile_rows": {name: RUNTIME.store.lookup(p).tile_rows for name, p in model.named_parameters()},
    }))


if __name__ == "__main__":
    main()
