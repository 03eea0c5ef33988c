"""One rank of the pipeline-parallel tests (issue 37): pp 2 x dp 2 at world 4 on gloo.

A stack of 4 residual MLP blocks cut into 2 stages of 2 blocks.  Each stage is compiled with zinf over
its data-parallel ranks (``mesh["dp"]``), wrapped in ``ZinfPipelineStage`` and driven by torch's
``ScheduleGPipe`` or ``Schedule1F1B`` with 4 micro-batches per dp rank, then stepped by zinf's AdamW.
The reference is the whole model in eager on the whole batch (both dp ranks' rows), torch's AdamW.
Records the losses (last stage), the stage's parameters after the steps, the collectives per step (and
the all-gathers of each micro-batch's forward, the reduce-scatters of each backward), the all-gathers of the traced step, and Dynamo's graph
count; or the error raised.
"""

import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import zinf_compiler as zinf
from zinf_compiler.api import RUNTIME
from zinf_compiler.pipeline_parallel import ZinfPipelineStage
from multirank import finish_rank, record_error, start_rank, write_result

WIDTH = 16
BLOCKS = 4  # two per stage
ROWS_PER_DP_RANK = 8
MICRO_BATCHES = 4
ADAMW = dict(lr=1e-2, eps=1e-6, weight_decay=0.1, fused=True)
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class Block(torch.nn.Module):
    def __init__(self, width: int, buffer: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)
        if buffer:  # a buffer the forward multiplies by: autograd saves it for the backward
            self.register_buffer("gain", torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        out = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return x + (out * self.gain if hasattr(self, "gain") else out)


BUFFER = False  # (args "buffer": every block has a buffer saved for backward)


def build() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block(WIDTH, BUFFER) for _ in range(BLOCKS)])


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


def batches(steps: int):
    """The whole batch of each step (every dp rank's rows): inputs and targets."""
    generator = torch.Generator().manual_seed(1234)
    rows = 2 * ROWS_PER_DP_RANK
    return [(torch.randn(rows, WIDTH, generator=generator), torch.randn(rows, WIDTH, generator=generator))
            for _ in range(steps)]


def eager_run(steps: int):
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for x, target in batches(steps):
        loss = loss_fn(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: value.detach() for name, value in model.named_parameters()}


def stage_module(stage: int) -> torch.nn.Sequential:
    """Stage ``stage``'s blocks, cut from the same initial model as the reference."""
    per_stage = BLOCKS // 2
    return torch.nn.Sequential(*list(build())[stage * per_stage : (stage + 1) * per_stage])


def main():
    args, world, rank = start_rank()
    global BUFFER
    BUFFER = args.get("buffer", False)
    steps = args.get("steps", 3)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    result = {"rank": rank, "stage": pp_rank}
    result["eager_losses"], eager_params = eager_run(steps)
    module = stage_module(pp_rank)
    zinf_mesh = {"dp": mesh["dp"], "whole": mesh, "none": None}[args.get("mesh", "dp")]
    options = {"stage": 3, "mesh": zinf_mesh, "lower": "eager", **args.get("options", {})}
    try:
        if "nvme" in (options.get("offload_param"), options.get("offload_optimizer")):
            options["nvme_path"] = os.path.join(os.environ["TMPDIR"], f"swap{rank}")
            os.makedirs(options["nvme_path"], exist_ok=True)
        if args.get("trace"):
            options["dump_dir"] = os.path.join(os.environ["TMPDIR"], f"dump{rank}")
        compiled = torch.compile(module, backend="zinf", options=options)
        micro_rows = ROWS_PER_DP_RANK // MICRO_BATCHES
        # One micro-batch's tensors at each end of the stage; a gradient flows back into stage 1's input.
        inputs = torch.empty(micro_rows, WIDTH, requires_grad=pp_rank > 0)
        if args.get("bad_boundary") and pp_rank == 1:  # (declares rows the stage before does not send)
            inputs = torch.empty(micro_rows + 1, WIDTH, requires_grad=True)
        outputs = torch.empty(micro_rows, WIDTH, requires_grad=True)
        stage = ZinfPipelineStage(compiled, pp_rank, 2, torch.device("cpu"), input_args=inputs,
                                  output_args=outputs, group=mesh["pp"].get_group(),
                                  gather_once=args.get("gather_once", "auto"),
                                  reduce_once=args.get("reduce_once", "auto"))
        per_micro_batch = {"forward_all_gathers": _count_per_micro_batch(stage, "forward_one_chunk", "all_gather"),
                           "backward_reduce_scatters": _count_per_micro_batch(stage, "backward_one_chunk",
                                                                              "reduce_scatter")}
        schedule = SCHEDULES[args["schedule"]](stage, n_microbatches=MICRO_BATCHES, loss_fn=loss_fn)
        optimizer = zinf.optim.AdamW(module.parameters(), **ADAMW)
        losses, calls = [], []
        torch._dynamo.utils.counters.clear()
        for x, target in batches(steps):
            rows = slice(dp_rank * ROWS_PER_DP_RANK, (dp_rank + 1) * ROWS_PER_DP_RANK)
            before = dict(RUNTIME.comm.calls)
            if pp_rank == 0:
                schedule.step(x[rows])
            else:
                micro_losses = []
                schedule.step(target=target[rows], losses=micro_losses)
                loss = torch.stack(micro_losses).mean().detach()
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
                losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
            calls.append({kind: count - before.get(kind, 0) for kind, count in RUNTIME.comm.calls.items()})
            for name, counts in per_micro_batch.items():
                calls[-1][name] = counts[:]
                counts.clear()
        result["zinf_losses"] = losses
        result["calls"] = calls
        result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        if args.get("trace"):
            summary = RUNTIME.tracer.last_summary or {}
            result["traced_gathers"] = _traced_gathers(RUNTIME.tracer.last_files[0])
            result["traced_gg_bytes"] = summary.get("track_bytes", {}).get("gg")
        full = zinf.full_state_dict(compiled)
        per_stage = BLOCKS // 2
        errors = {}
        for name, value in full.items():
            index, rest = name.split(".", 1)
            if rest == "gain":
                continue  # (a buffer: never trained)
            expected = eager_params[f"{int(index) + pp_rank * per_stage}.{rest}"]
            scale = expected.abs().max().clamp_min(1e-12)
            errors[name] = ((expected - value).abs().max() / scale).item()
        result["param_errors"] = errors
    except Exception as err:
        record_error(result, err)
    write_result(result)
    finish_rank()


def _count_per_micro_batch(stage, method: str, kind: str) -> list[int]:
    """A list that gets the collectives of ``kind`` run by each call of the stage's ``method`` (one
    micro-batch's forward or backward)."""
    counts, run = [], getattr(stage, method)

    def counting(*args, **kwargs):
        before = RUNTIME.comm.calls.get(kind, 0)
        output = run(*args, **kwargs)
        counts.append(RUNTIME.comm.calls.get(kind, 0) - before)
        return output

    setattr(stage, method, counting)
    return counts


def _traced_gathers(trace_path: str) -> int:
    """The parameter all-gathers of the traced step, read from its Chrome trace: the intervals on track
    ``gg`` that moved bytes (each is named after its track; the agreement's small all-gathers count 0)."""
    with open(trace_path) as handle:
        events = json.load(handle)["traceEvents"]
    tracks = {event["tid"]: event["args"]["name"] for event in events
              if event["ph"] == "M" and event["name"] == "thread_name"}
    return sum(1 for event in events if event["ph"] == "X" and tracks[event["tid"]] == "gg"
               and event["args"]["bytes"] > 0)


if __name__ == "__main__":
    main()
