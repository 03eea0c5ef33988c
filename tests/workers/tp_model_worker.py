"""One rank of the tensor-parallel acceptance tests (issue 37, acceptance 1): the GPT and a tiny Llama.

Layouts (``"layout"``): ``tp2dp2`` (world 4, ``init_device_mesh(("dp", "tp"))``), ``tp2dp1`` and ``tp1dp2``
(world 2; tp 1 is the plain model over the default group).  The model goes through torch's TP plan
(``parallelize_module`` per layer), compiles with zinf at stage 3 over ``mesh["dp"]`` and trains with zinf's
AdamW on this dp rank's share of each whole batch (``BATCH`` rows at every layout: a load at another dp size
takes the saving run's batches); the reference is the plain model in eager on the whole batch
(``torch.optim.AdamW``).  ``"phase"``:

- ``train`` (tp2dp2): the losses (averaged over dp: the whole batch's) and ``zinf.full_state_dict`` beside
  eager's, and ``memory_report``; with ``"checkpoint"`` (a folder): ``zinf.save`` after step ``steps - 1``,
  the last step, then a second model loaded from the save takes the same step (bytes compared), and
  ``zinf.export`` of the trained model, read back by ``from_pretrained`` (Llama) on rank 0.
- ``load`` (any layout): ``zinf.load`` of that checkpoint into a fresh model: its ``full_state_dict``
  against the one saved (bytes), then the last step against the saving run's.
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from multirank import finish_rank, record_error, start_rank, write_result
from usage import relative_error

ADAMW = dict(lr=1e-2, eps=1e-4, weight_decay=0.01)  # (test_hf_zoo's: eps 1e-4 keeps rounding from growing)
BATCH = 4  # the rows of a whole batch, at every layout (each dp rank takes its share)
SEQ = 16


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind.startswith("gpt"):  # ("gpt_fused": the default GPT, its attention one fused qkv Linear)
        from zinf_compiler.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=4, n_embd=32,
                             separate_qkv=kind in ("gpt", "gpt_sp")))
    import transformers

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                      max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config)


def parallelize(model: torch.nn.Module, kind: str, tp_mesh) -> None:
    """torch's plan: colwise q/k/v and up/gate, rowwise o and down (HF Llama views heads as -1; the GPT, built
    with ``separate_qkv``, counts its heads from q's width: each tp rank computes its own heads).  The GPT's
    MLP is fc colwise, proj rowwise; its tied embedding / LM head and position embedding stay whole over tp.
    The Llama's embedding (rowwise, over the vocabulary) and LM head (colwise, output replicated) are split
    too, as torchtitan does: each rank then holds about a quarter of the model."""
    if kind == "gpt_fused":  # (the naive plan, refused by the GPT: colwise would mix q, k and v)
        for block in model.blocks:
            parallelize_module(block, tp_mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()})
        return
    if kind == "gpt_sp":  # (sequence parallel: the residual stream sharded over tp along the sequence)
        sequence_parallel(model, tp_mesh)
        return
    if kind == "gpt":
        for block in model.blocks:
            parallelize_module(block, tp_mesh, {
                "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
        return
    if kind == "llama_lp":  # (loss parallel: the LM head's logits stay sharded over the vocabulary)
        from torch.distributed.tensor import Shard

        lm_head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    else:
        lm_head = ColwiseParallel(output_layouts=Replicate())
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, tp_mesh, {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                        "lm_head": lm_head})


def sequence_parallel(model: torch.nn.Module, tp_mesh) -> None:
    """The GPT's blocks with sequence parallelism (torchtitan's plan on the GPT's modules): each block's input
    is split along the sequence over tp, its LayerNorms run on their sequence shard (``SequenceParallel``),
    attention and the MLP gather the sequence before their colwise Linears and reduce-scatter it back after
    their rowwise ones; the last block's output is whole again for ``ln_f`` and the LM head."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, SequenceParallel

    last = len(model.blocks) - 1
    for index, block in enumerate(model.blocks):
        parallelize_module(block, tp_mesh, {
            "": PrepareModuleInput(input_layouts=(Replicate() if index == 0 else Shard(1),),
                                   desired_input_layouts=(Shard(1),), use_local_output=False),
            "ln1": SequenceParallel(), "ln2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
        if index == last:
            parallelize_module(block, tp_mesh, {"": PrepareModuleOutput(
                output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True)})


def whole_batch(kind: str, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1 + step)
    return torch.randint(3, 64 if kind.startswith("gpt") else 128, (BATCH, SEQ + 1), generator=generator)


def loss_of(model, kind: str, ids: torch.Tensor) -> torch.Tensor:
    if kind.startswith("gpt"):
        return model(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    if kind == "llama_lp":
        # The loss outside the model, as torchtitan computes a parallel loss: the compiled graph returns only the
        # logits (the model's own loss beside its logits would be two outputs needing gradients, of which
        # backward reaches one: AOTAutograd then guesses the other's tangent wrong, torch issue 172556).
        logits = model(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return model(input_ids=ids, labels=ids).loss


def forward_backward(model, kind: str, ids: torch.Tensor) -> torch.Tensor:
    """One batch's forward and backward; its loss, a plain tensor.  With loss parallel (``llama_lp`` under TP)
    both run in torch's ``loss_parallel`` context: the cross-entropy of logits sharded over the vocabulary."""
    import contextlib

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    parallel_loss = kind == "llama_lp" and isinstance(model.lm_head.weight, DTensor)
    with loss_parallel() if parallel_loss else contextlib.nullcontext():
        loss = loss_of(model, kind, ids)
        loss.backward()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def eager_run(kind: str, steps: int):
    """The reference: the plain model in eager on the whole batch."""
    model = build(kind)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)  # (zinf's AdamW runs the fused kernel)
    losses = []
    for step in range(steps):
        loss = forward_backward(model, kind, whole_batch(kind, step))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model, losses


class Layout:
    """This rank's place in a tp x dp layout: the tp mesh (None at tp 1), the dp group and rank."""

    def __init__(self, name: str, world: int):
        self.tp = int(name[2])
        self.dp = world // self.tp
        if self.tp > 1:
            self.mesh = init_device_mesh("cpu", (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
            self.tp_mesh, self.dp_mesh = self.mesh["tp"], self.mesh["dp"]
            self.dp_rank, self.dp_group = self.dp_mesh.get_local_rank(), self.dp_mesh.get_group()
        else:
            self.tp_mesh = self.dp_mesh = None
            self.dp_rank, self.dp_group = dist.get_rank(), None

    def model(self, kind: str, options: dict, nvme_root: str, tag: str):
        """The model in this layout, compiled with zinf (stage 3 over the dp mesh), and zinf's AdamW."""
        import zinf_compiler as zinf

        model = build(kind)
        if self.tp_mesh is not None:
            parallelize(model, kind, self.tp_mesh)
        options = {"stage": 3, "lower": "eager", **options}
        if self.dp_mesh is not None:
            options["mesh"] = self.dp_mesh
        if "nvme" in (options.get("offload_param"), options.get("offload_optimizer")):
            options["nvme_path"] = os.path.join(nvme_root, f"swap-{tag}-{dist.get_rank()}")
            os.makedirs(options["nvme_path"], exist_ok=True)
        return model, torch.compile(model, backend="zinf", options=options), zinf.optim.AdamW(model.parameters(),
                                                                                             **ADAMW)

    def step(self, compiled, optimizer, kind: str, step: int) -> float:
        """One step on this dp rank's rows; the whole batch's loss (the mean over dp ranks)."""
        share = BATCH // self.dp
        rows = whole_batch(kind, step)[self.dp_rank * share:(self.dp_rank + 1) * share]
        loss = forward_backward(compiled, kind, rows)
        optimizer.step()
        optimizer.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=self.dp_group)
        return whole.item() / self.dp


def full_state(model) -> dict:
    import zinf_compiler as zinf

    return {name: value.detach().clone() for name, value in zinf.full_state_dict(model).items()}


def differing(state: dict, expected: dict) -> list:
    """Names whose tensors differ from ``expected``'s in any byte."""
    return [name for name, value in expected.items() if not torch.equal(state[name].view(-1).view(torch.uint8),
                                                                         value.view(-1).view(torch.uint8))]


def states_bytes(report: dict) -> int:
    return sum(report[tier][kind] for tier in ("device", "cpu", "nvme") for kind in ("params", "optimizer"))


def train_phase(args: dict, layout: Layout, result: dict) -> None:
    import zinf_compiler as zinf

    kind, steps, options, root = args["model"], args.get("steps", 3), args.get("options", {}), args.get("checkpoint")
    eager, result["eager_losses"] = eager_run(kind, steps)
    model, compiled, optimizer = layout.model(kind, options, os.environ["TMPDIR"], "train")
    losses = []
    for step in range(steps):
        if root is not None and step == steps - 1:
            zinf.save(os.path.join(root, "ckpt"), model, optimizer)
            saved = full_state(model)
            if dist.get_rank() == 0:
                torch.save(saved, os.path.join(root, "saved.pt"))
        losses.append(layout.step(compiled, optimizer, kind, step))
    result["zinf_losses"] = losses
    state = full_state(model)
    eager_state = eager.state_dict()
    result["param_errors"] = {name: relative_error(value, state[name]) for name, value in eager_state.items()}
    result["param_abs_errors"] = {name: (value - state[name]).abs().max().item() for name, value in eager_state.items()}
    report = zinf.memory_report(model)
    whole_params = sum(p.numel() * p.element_size() for p in eager.parameters())
    result["states_fraction"] = states_bytes(report) / (3 * whole_params)  # (params, exp_avg, exp_avg_sq)
    result["params_fraction"] = sum(report[tier]["params"] for tier in ("device", "cpu", "nvme")) / whole_params
    if root is None:
        return
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(root, "continued.pt"))
    # The same step from the checkpoint, in a second model: equal to the bit.
    model2, compiled2, optimizer2 = layout.model(kind, options, os.environ["TMPDIR"], "resumed")
    zinf.load(os.path.join(root, "ckpt"), model2, optimizer2)
    result["loaded_differs"] = differing(full_state(model2), saved)
    result["resumed_loss"] = layout.step(compiled2, optimizer2, kind, steps - 1)
    result["resumed_differs"] = differing(full_state(model2), state)
    zinf.export(os.path.join(root, "export"), model)
    if dist.get_rank() == 0 and kind == "llama":
        import transformers

        exported = transformers.LlamaForCausalLM.from_pretrained(os.path.join(root, "export"))
        result["export_errors"] = {name: relative_error(value, exported.state_dict()[name])
                                   for name, value in eager_state.items()}
        result["export_differs"] = differing({k: v.detach() for k, v in exported.state_dict().items()}, state)


def load_phase(args: dict, layout: Layout, result: dict) -> None:
    """A fresh model in this layout, loaded from the tp 2 x dp 2 save: the saved whole tensors to the byte,
    then the last step against the saving run's (within the suite's tolerance: another reduction order)."""
    import zinf_compiler as zinf

    kind, steps, root = args["model"], args.get("steps", 3), args["checkpoint"]
    model, compiled, optimizer = layout.model(kind, args.get("options", {}), os.environ["TMPDIR"], "load")
    zinf.load(os.path.join(root, "ckpt"), model, optimizer)
    result["loaded_differs"] = differing(full_state(model), torch.load(os.path.join(root, "saved.pt")))
    result["loss"] = layout.step(compiled, optimizer, kind, steps - 1)
    continued = torch.load(os.path.join(root, "continued.pt"))
    state = full_state(model)
    result["param_errors"] = {name: relative_error(value, state[name]) for name, value in continued.items()}


def break_graph_after_qkv(raising: bool = False) -> None:
    """The GPT's attention with a graph break right after its q/k/v projections (``"break_after_qkv"``): under TP
    the break falls between DTensor ops, where zinf's backend once failed ("Node tangents_... was invalid, but
    is output").  The same code in eager and compiled runs.  ``raising``: the traced forward raises there (Dynamo
    compiles the graph up to the raise, whose outputs are DTensors under TP, and runs the rest eagerly), as the
    GPT's refusal of a fused qkv did in a first version, which is where that failure was seen."""
    import torch.nn.functional as F
    from zinf_compiler import gpt

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if raising and torch.compiler.is_compiling():
            # (Dynamo cannot trace the raise: it compiles the graph up to here and runs the rest eagerly,
            # where nothing raises)
            raise ValueError("the model's own error, after q/k/v")
        torch._dynamo.graph_break()
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(batch, seq, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim))

    gpt.CausalSelfAttention.forward = forward


def main():
    args, world, rank = start_rank()
    result = {"rank": rank}
    if args.get("break_after_qkv") or args.get("raise_after_qkv"):
        break_graph_after_qkv(raising=args.get("raise_after_qkv", False))
    try:
        layout = Layout(args.get("layout", "tp2dp2"), world)
        (load_phase if args.get("phase") == "load" else train_phase)(args, layout, result)
    except Exception as err:
        record_error(result, err)
    write_result(result)
    finish_rank()


if __name__ == "__main__":
    main()
