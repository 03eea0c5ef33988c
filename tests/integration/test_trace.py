"""Issue 5 acceptance 4: with dump_dir, one step is traced as valid Chrome trace JSON.

The trace has one track per kind of work; with the default schedule and
parameters on NVMe, reads (nc) run while the main thread computes, so the
compute and I/O tracks overlap.  The bytes-per-tier picture is written too.
"""

from __future__ import annotations

import gc
import json
import os

import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from zinf_compiler.runtime.trace import TRACKS, TRANSFER_TRACKS, union_seconds
from zinf_compiler.api import RUNTIME

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=128)


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total = 0.0
    for a_start, a_stop in a:
        for b_start, b_stop in b:
            total += max(0.0, min(a_stop, b_stop) - max(a_start, b_start))
    return total


def test_trace_is_chrome_json_with_overlapping_compute_and_io(tmp_path):
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = GPT(CFG)
    swap = tmp_path / "swap"
    swap.mkdir()
    dump = tmp_path / "dump"
    compiled = torch.compile(model, backend="zinf", options={
        "stage": 3, "lower": "eager", "offload_param": "nvme", "offload_optimizer": "cpu",
        "nvme_path": str(swap), "dump_dir": str(dump), "trace_step": 2})
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
    for idx, targets in synthetic_batches(CFG, 2, 3):
        compiled(idx, targets).backward()
        opt.step()
        opt.zero_grad()
    assert [os.path.basename(f) for f in RUNTIME.tracer.last_files] == ["trace.json", "memory.png"]
    trace_path = dump / "trace.json"
    assert trace_path.exists()
    assert (dump / "memory.png").stat().st_size > 1000
    trace = json.loads(trace_path.read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(names.values()) == set(TRACKS)
    spans = {track: [] for track in TRACKS}
    for event in events:
        assert event["ph"] in ("M", "X", "C", "i"), event
        if event["ph"] == "X":
            assert isinstance(event["ts"], (int, float)) and event["dur"] >= 0 and event["pid"] == 0
            spans[names[event["tid"]]].append((event["ts"], event["ts"] + event["dur"]))
        if event["ph"] == "C":
            assert set(event["args"]) >= {"device", "cpu", "pinned in use", "nvme"}
    # (No gg or rs at world size 1: the staged shard is the whole parameter, a gradient
    # is only copied into its shard.)
    for track in ("compute", "nc", "cg", "offload"):
        assert spans[track], f"no {track} intervals"
    io = [span for track in TRANSFER_TRACKS for span in spans[track]]
    assert overlap_seconds(spans["compute"], spans["nc"]) > 0
    assert overlap_seconds(spans["compute"], io) > 0
    summary = trace["otherData"]["summary"]
    # The compute track is the step minus the main thread's stalls.
    assert abs(summary["compute_seconds"] + summary["stall_seconds"] - summary["step_seconds"]) < 1e-3
    assert abs(summary["transfer_seconds"] * 1e6 - union_seconds(io)) < 1.0
    assert summary["track_bytes"]["nc"] > 0
    graphs, optimizer = summary["graphs"], summary["optimizer"]
    assert abs(graphs["step_seconds"] + optimizer["step_seconds"] - summary["step_seconds"]) < 1e-6



def test_each_model_traces_its_own_step_and_a_dropped_one_leaves_nothing_armed(tmp_path):
    # The tracer is the process's: it counted every optimizer's steps, and a model dropped between its
    # steps 1 and 2 left its recording open, which swallowed the next model's arm (that trace was never
    # written; found when the test order changed under parallel test workers).
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    batches = list(synthetic_batches(cfg, 2, 2))

    def model_and_optimizer(**options):
        model = GPT(cfg)
        compiled = torch.compile(model, backend="zinf", options={"stage": 3, "lower": "eager", **options})
        return compiled, zinf.optim.AdamW(model.parameters(), lr=1e-3)

    def train_step(compiled, opt, batch):
        compiled(*batch).backward()
        opt.step()
        opt.zero_grad()

    dropped = model_and_optimizer(dump_dir=str(tmp_path / "dropped"))
    train_step(*dropped, batches[0])
    assert RUNTIME.tracer.recording  # its step 2 is being traced
    del dropped
    gc.collect()
    traced = model_and_optimizer(dump_dir=str(tmp_path / "traced"))
    other = model_and_optimizer()
    train_step(*traced, batches[0])  # compiles and arms: the dropped model's recording is ended unwritten
    assert RUNTIME.tracer.recording  # the traced model's step 2
    train_step(*other, batches[0])
    train_step(*other, batches[1])  # another model's steps do not end it
    assert RUNTIME.tracer.recording and not (tmp_path / "traced" / "trace.json").exists()
    train_step(*traced, batches[1])
    assert not RUNTIME.tracer.recording
    assert (tmp_path / "traced" / "trace.json").exists()
    assert not (tmp_path / "dropped" / "trace.json").exists()
