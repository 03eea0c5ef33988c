"""One rank of the 3-D test (issue 37, acceptance 3): pp 2 x dp 2 x tp 2 at world 8 on gloo.

``init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))``.  A small GPT (``separate_qkv``, its
LM head untied from the embedding: the two lie in different stages) is cut into 2 stages of blocks
(``zinf_compiler/gpt_parallel.py``); each stage's blocks go through torch's TP plan over ``mesh["tp"]``, the stage
is compiled with zinf at stage 3 over ``mesh["dp"]``, wrapped in ``ZinfPipelineStage`` and driven by
``Schedule1F1B`` with 4 micro-batches per dp rank; zinf's AdamW steps it.  The reference is the same untied
model in eager in one process on the whole batch (both dp ranks' rows), ``torch.optim.AdamW``.  Records the
whole batch's losses (the last stage's, averaged over dp), the relative and absolute errors of every whole
parameter (``zinf.full_state_dict``: gathered over dp, then over tp) against eager's, and Dynamo's graph count;
or the error raised.  ``"lower"``: zinf's lowering (default ``"eager"``); ``"clip"``: a max_norm both clip at before
each step (torch's ``clip_grad_norm_`` over the stage's parameters on every rank), their norms recorded.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig
from zinf_compiler.gpt_parallel import GPTStage, parallelize_blocks, stage_loss, untie_head
from zinf_compiler.pipeline_parallel import ZinfPipelineStage
from multirank import finish_rank, record_error, start_rank, write_result
from usage import relative_error

PP, DP, TP = 2, 2, 2
MICRO_BATCHES = 4
MICRO_ROWS = 1
ROWS = DP * MICRO_BATCHES * MICRO_ROWS  # the whole batch
SEQ = 16
CONFIG = GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, separate_qkv=True)
ADAMW = dict(lr=1e-2, eps=1e-4, weight_decay=0.01)  # (tp_model_worker's)


def build() -> GPT:
    torch.manual_seed(0)
    return untie_head(GPT(CONFIG))


def whole_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def eager_run(steps: int, clip: float | None = None):
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)  # (zinf's AdamW runs the fused kernel)
    losses, norms = [], []
    for step in range(steps):
        loss = model(*whole_batch(step))
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses, norms


def train(args: dict, mesh, result: dict) -> None:
    steps = args.get("steps", 3)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    clip = args.get("clip")
    eager, result["eager_losses"], result["eager_norms"] = eager_run(steps, clip)
    module = GPTStage(build(), pp_rank, PP)
    parallelize_blocks(module, mesh["tp"])
    options = {"stage": 3, "mesh": mesh["dp"], "lower": args.get("lower", "eager"), **args.get("options", {})}
    compiled = torch.compile(module, backend="zinf", options=options)
    activations = torch.empty(MICRO_ROWS, SEQ, CONFIG.n_embd, requires_grad=True)
    ids = torch.zeros(MICRO_ROWS, SEQ, dtype=torch.long)
    logits = torch.empty(MICRO_ROWS, SEQ, CONFIG.vocab_size, requires_grad=True)
    stage = ZinfPipelineStage(compiled, pp_rank, PP, torch.device("cpu"),
                              input_args=ids if pp_rank == 0 else activations,
                              output_args=activations if pp_rank == 0 else logits, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=MICRO_BATCHES, loss_fn=stage_loss)
    optimizer = zinf.optim.AdamW(module.parameters(), **ADAMW)
    torch._dynamo.utils.counters.clear()
    losses, norms = [], []
    rows = slice(dp_rank * MICRO_BATCHES * MICRO_ROWS, (dp_rank + 1) * MICRO_BATCHES * MICRO_ROWS)
    for step in range(steps):
        inputs, targets = whole_batch(step)
        if pp_rank == 0:
            schedule.step(inputs[rows])
        else:
            micro_losses = []
            schedule.step(target=targets[rows], losses=micro_losses)
            loss = torch.stack(micro_losses).mean().detach()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            losses.append(loss.item())
        if clip is not None:
            # torch's clip_grad_norm_ over the stage's parameters: zinf takes it over the whole model.
            norms.append(torch.nn.utils.clip_grad_norm_(module.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
    result["zinf_losses"], result["zinf_norms"] = losses, norms
    result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    state = {module.whole_name(name): value for name, value in zinf.full_state_dict(compiled).items()}
    eager_state = {name: value.detach() for name, value in eager.named_parameters()}
    result["param_errors"] = {name: relative_error(eager_state[name], value) for name, value in state.items()}
    result["param_abs_errors"] = {name: (eager_state[name] - value).abs().max().item()
                                  for name, value in state.items()}


def main():
    args, world, rank = start_rank()
    result = {"rank": rank}
    try:
        mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
        result["stage"] = mesh["pp"].get_local_rank()
        train(args, mesh, result)
    except Exception as err:
        record_error(result, err)
    write_result(result)
    finish_rank()


if __name__ == "__main__":
    main()
