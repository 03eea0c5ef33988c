"""One rank of the pipeline checkpoint tests (issue 52, acceptance 1): save, load and export a pp x tp x dp GPT.

``init_device_mesh("cpu", (pp, dp, tp), ("pp", "dp", "tp"))`` from ``args`` (world = pp * dp * tp).  The small
GPT of three_d_worker (``separate_qkv``, its head untied) is cut into ``pp`` stages of blocks, each stage's blocks
split over ``tp`` ranks by torch's TP plan, compiled with zinf at stage 3 over ``mesh["dp"]`` (NVMe tiers with
``"nvme"``), wrapped in ``ZinfPipelineStage`` and driven by ``Schedule1F1B``, one row per micro-batch; zinf's AdamW
steps it.  The whole batch of a step is the same at every layout (``ROWS`` rows, split over dp).

``"mode"``:

* ``"save"``: train ``"before"`` steps, ``zinf.save`` into ``<dir>/ckpt/step-<n>`` (``extra`` the step), train
  ``"after"`` more steps (the straight run), then a second pipeline in the same process (new modules, compiled
  anew) loads that checkpoint and trains the same ``"after"`` steps (the resumed run); records both runs' losses
  and whole parameters, and ``zinf.export`` of the resumed run into ``<dir>/export``.  With ``"fail_save"``:
  before the resumed run, a save into ``<dir>/ckpt/step-9`` whose stage 1 fails as a full disk would
  (``OSError(ENOSPC)`` on its ranks' writes) and ``zinf.latest`` afterwards.
* ``"load"``: a pipeline of this layout loads ``<dir>/ckpt/step-<before>`` and trains ``"after"`` steps; records
  them (or the error the load raised: ``"load_error"``).
"""

import errno
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import Schedule1F1B

import zinf_compiler as zinf
from zinf_compiler.checkpoint import saving
from zinf_compiler.gpt import GPT, GPTConfig
from zinf_compiler.gpt_parallel import GPTStage, parallelize_blocks, stage_loss, untie_head
from zinf_compiler.pipeline_parallel import ZinfPipelineStage
from multirank import finish_rank, record_error, start_rank, write_result

ROWS = 4  # the whole batch, one row per micro-batch
SEQ = 16
CONFIG = GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, separate_qkv=True)
ADAMW = dict(lr=1e-2, eps=1e-4, weight_decay=0.01)


def whole_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class Pipeline:
    """The model of this rank's stage, its ZinfPipelineStage, schedule and optimizer."""

    def __init__(self, args: dict, mesh):
        self.mesh, self.pp = mesh, mesh["pp"].size()
        self.pp_rank, self.dp, self.dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].size(), mesh["dp"].get_local_rank()
        torch.manual_seed(0)
        self.module = GPTStage(untie_head(GPT(CONFIG)), self.pp_rank, self.pp)
        if mesh["tp"].size() > 1:
            parallelize_blocks(self.module, mesh["tp"])
        options = {"stage": 3, "mesh": mesh["dp"], "lower": args.get("lower", "eager")}
        if args.get("nvme"):
            options.update(offload_param="nvme", offload_optimizer="nvme", nvme_path=args["nvme"])
        self.compiled = torch.compile(self.module, backend="zinf", options=options)
        micro_batches = ROWS // self.dp
        activations = torch.empty(1, SEQ, CONFIG.n_embd, requires_grad=True)
        ids = torch.zeros(1, SEQ, dtype=torch.long)
        logits = torch.empty(1, SEQ, CONFIG.vocab_size, requires_grad=True)
        last = self.pp_rank == self.pp - 1
        self.stage = ZinfPipelineStage(self.compiled, self.pp_rank, self.pp, torch.device("cpu"),
                                       input_args=ids if self.pp_rank == 0 else activations,
                                       output_args=logits if last else activations, group=mesh["pp"].get_group())
        self.schedule = Schedule1F1B(self.stage, n_microbatches=micro_batches, loss_fn=stage_loss)
        self.optimizer = zinf.optim.AdamW(self.module.parameters(), **ADAMW)

    def train(self, steps: range) -> list[float]:
        """The whole batch's loss of each step, on every rank (the last stage's, averaged over dp)."""
        losses = []
        rows = slice(self.dp_rank * ROWS // self.dp, (self.dp_rank + 1) * ROWS // self.dp)
        for step in steps:
            inputs, targets = whole_batch(step)
            micro_losses = []
            if self.pp_rank == 0:
                self.schedule.step(inputs[rows])
            elif self.pp_rank == self.pp - 1:
                self.schedule.step(target=targets[rows], losses=micro_losses)
            else:
                self.schedule.step()
            self.optimizer.clip_grad_norm_(1.0)
            self.optimizer.step()
            self.optimizer.zero_grad()
            last = self.pp_rank == self.pp - 1
            loss = torch.stack(micro_losses).mean().detach() if last else torch.zeros(())
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.mesh["dp"].get_group())
            dist.all_reduce(loss, group=self.mesh["pp"].get_group())
            losses.append(loss.item())
        return losses

    def params(self) -> dict[str, list]:
        """This stage's whole parameters by the whole model's names (gathered over dp and tp)."""
        state = zinf.full_state_dict(self.compiled)
        return {self.module.whole_name(name): value.reshape(-1).tolist() for name, value in state.items()}


def _fail_stage_1_writes(pipeline: Pipeline) -> None:
    """Stage 1's ranks fail every checkpoint write from now on, as on a full disk."""
    if pipeline.pp_rank != 1:
        return

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device (planted)")

    saving._write_rank = full_disk


def run(args: dict, mesh, result: dict) -> None:
    before, after = args.get("before", 2), args.get("after", 3)
    root = os.path.join(args["dir"], "ckpt")
    path = os.path.join(root, f"step-{before}")
    if args["mode"] == "save":
        straight = Pipeline(args, mesh)
        result["before_losses"] = straight.train(range(before))
        zinf.save(path, straight.stage, straight.optimizer, extra={"step": before})
        result["latest"] = zinf.latest(root)
        result["straight_losses"] = straight.train(range(before, before + after))
        result["straight_params"] = straight.params()
        if args.get("fail_save"):
            _fail_stage_1_writes(straight)
            try:
                zinf.save(os.path.join(root, "step-9"), straight.compiled, straight.optimizer)
                result["failed_save"] = None
            except zinf.ZinfCheckpointError as err:
                result["failed_save"] = str(err)
            result["latest_after_failure"] = zinf.latest(root)
            result["left_behind"] = sorted(os.listdir(root))
    resumed = Pipeline(args, mesh)
    try:
        extra = zinf.load(path, resumed.compiled, resumed.optimizer)
    except zinf.ZinfCheckpointError as err:
        result["load_error"] = str(err)
        return
    result["extra"] = extra
    result["resumed_losses"] = resumed.train(range(before, before + after))
    result["resumed_params"] = resumed.params()
    if args["mode"] == "save":
        zinf.export(os.path.join(args["dir"], "export"), resumed.stage)


def main():
    args, world, rank = start_rank()
    result = {"rank": rank}
    try:
        pp, tp = args["pp"], args.get("tp", 1)
        mesh = init_device_mesh("cpu", (pp, world // (pp * tp), tp), mesh_dim_names=("pp", "dp", "tp"))
        result["stage"] = mesh["pp"].get_local_rank()
        run(args, mesh, result)
    except Exception as err:
        record_error(result, err)
    write_result(result)
    finish_rank()


if __name__ == "__main__":
    main()
