"""One rank of the pipeline checkpoint tests (issue 52, acceptances 1 and 5): save, load and export a pp x tp x dp
GPT or Hugging Face Llama, equal to eager.

``init_device_mesh("cpu", (pp, dp, tp), ("pp", "dp", "tp"))`` from ``args`` (world = pp * dp * tp).  ``"model"``:
the small GPT of three_d_worker (``separate_qkv``, its head untied; the default) or a tiny ``LlamaForCausalLM``
(``"llama"``: :class:`LlamaStage`, cut as torchtitan cuts it).  It is cut into ``pp`` stages of blocks, each stage's
blocks split over ``tp`` ranks by torch's TP plan (the Llama's embedding and LM head too), compiled with zinf at
stage 3 over ``mesh["dp"]`` (NVMe tiers with ``"nvme"``), wrapped in ``ZinfPipelineStage`` and driven by
``Schedule1F1B``, one row per micro-batch; zinf's AdamW steps it, clipped at 1.0.  The whole batch of a step is
the same at every layout (``ROWS`` rows, split over dp).  Every run also records the eager model's losses and
final parameters on the whole batch (torch's AdamW, clipped alike) for the steps the straight run takes.

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
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from zinf_compiler.checkpoint import saving
from zinf_compiler.gpt import GPT, GPTConfig
from zinf_compiler.gpt_parallel import GPTStage, parallelize_blocks, stage_loss, untie_head
from zinf_compiler.pipeline_parallel import ZinfPipelineStage
from multirank import finish_rank, record_error, start_rank, write_result

ROWS = 4  # the whole batch, one row per micro-batch
SEQ = 16
CONFIG = GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32, separate_qkv=True)
ADAMW = dict(lr=1e-2, eps=1e-4, weight_decay=0.01)
CLIP = 1.0


def build(kind: str) -> nn.Module:
    """The whole model, the same on every rank."""
    torch.manual_seed(0)
    if kind == "gpt":
        return untie_head(GPT(CONFIG))
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=CONFIG.vocab_size,
                                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      use_cache=False, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


class LlamaStage(nn.Module):
    """Stage ``index`` of ``count`` of a ``LlamaForCausalLM``, cut by decoder layers: the first stage also embeds
    the tokens, the last holds the final norm and the LM head; every stage has the rotary embedding (positions
    0..seq-1; the causal mask is SDPA's own).  The modules are the model's; :meth:`whole_name` gives the whole
    model's names (what ``zinf.export`` writes, and ``from_pretrained`` reads)."""

    def __init__(self, model: nn.Module, index: int, count: int):
        super().__init__()
        inner, per_stage = model.model, model.config.num_hidden_layers // count
        self.index, self.count, self.first_layer = index, count, index * per_stage
        self.config = model.config  # (export writes config.json from the first stage's)
        self.layers = nn.ModuleList(inner.layers[self.first_layer:self.first_layer + per_stage])
        self.rotary_emb = inner.rotary_emb
        if index == 0:
            self.embed_tokens = inner.embed_tokens
        if index == count - 1:
            self.norm, self.lm_head = inner.norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 0:
            x = self.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, position_ids=positions, position_embeddings=position_embeddings)
        if self.index == self.count - 1:
            x = self.lm_head(self.norm(x))
        return x

    def whole_name(self, name: str) -> str:
        if name.startswith("layers."):
            _, number, rest = name.split(".", 2)
            return f"model.layers.{int(number) + self.first_layer}.{rest}"
        return name if name.startswith("lm_head.") else f"model.{name}"


def llama_tp(module: LlamaStage, tp_mesh) -> None:
    """torch's plan on the stage: colwise q/k/v and gate/up, rowwise o and down; the embedding rowwise over the
    vocabulary and the LM head colwise with its logits replicated (as torchtitan)."""
    for layer in module.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    if module.index == 0:
        parallelize_module(module, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    if module.index == module.count - 1:
        parallelize_module(module, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})


def eager_run(kind: str, steps: int) -> tuple[list[float], dict[str, list]]:
    """The eager model on the whole batch: each step's loss, and the final parameters."""
    model = build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)  # (zinf's AdamW runs the fused kernel)
    losses = []
    for step in range(steps):
        inputs, targets = whole_batch(step)
        loss = model(inputs, targets) if kind == "gpt" else stage_loss(model(input_ids=inputs).logits, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: param.detach().reshape(-1).tolist() for name, param in model.named_parameters()}


def whole_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (ROWS, SEQ + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


class Pipeline:
    """The model of this rank's stage, its ZinfPipelineStage, schedule and optimizer."""

    def __init__(self, args: dict, mesh):
        self.mesh, self.pp = mesh, mesh["pp"].size()
        self.pp_rank, self.dp, self.dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].size(), mesh["dp"].get_local_rank()
        kind = args.get("model", "gpt")
        stage_of = GPTStage if kind == "gpt" else LlamaStage
        self.module = stage_of(build(kind), self.pp_rank, self.pp)
        if mesh["tp"].size() > 1:
            (parallelize_blocks if kind == "gpt" else llama_tp)(self.module, mesh["tp"])
        hidden = CONFIG.n_embd if kind == "gpt" else self.module.config.hidden_size
        options = {"stage": 3, "mesh": mesh["dp"], "lower": args.get("lower", "eager")}
        if args.get("nvme"):
            options.update(offload_param="nvme", offload_optimizer="nvme", nvme_path=args["nvme"])
        self.compiled = torch.compile(self.module, backend="zinf", options=options)
        micro_batches = ROWS // self.dp
        activations = torch.empty(1, SEQ, hidden, requires_grad=True)
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
            self.optimizer.clip_grad_norm_(CLIP)
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
        result["eager_losses"], eager_params = eager_run(args.get("model", "gpt"), before + after)
        straight = Pipeline(args, mesh)
        result["before_losses"] = straight.train(range(before))
        zinf.save(path, straight.stage, straight.optimizer, extra={"step": before})
        result["latest"] = zinf.latest(root)
        result["straight_losses"] = straight.train(range(before, before + after))
        result["straight_params"] = straight.params()
        result["eager_params"] = {name: eager_params[name] for name in result["straight_params"]}
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
