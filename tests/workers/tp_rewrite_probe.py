"""Approach A' probe (issue 37 spike; run by hand, not a test): rewrite the Dynamo graph so that each DTensor
parameter input becomes a plain input (its local tensor) followed by DTensor.from_local; AOTAutograd then sees
no subclass input.  Run: python -c "from multirank import run_ranks; print(run_ranks(4, 'tp_rewrite_probe', {}))"
with PYTHONPATH=tests/support.  Compares the local gradients with eager DTensor's."""
import json, os, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_worker import build, batch_of
from multirank import start_rank, finish_rank
from torch._dynamo.backends.common import aot_autograd
from functorch.compile import make_boxed_func

args, world, rank = start_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
out = {}
aliases = {}

def backend(gm, example_inputs):
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    slots = {}
    new_inputs = list(example_inputs)
    for i, (node, ex) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(ex, DTensor):
            spec = (ex.device_mesh, tuple(ex.placements), ex.shape, ex.stride())
            slots[i] = spec
            with gm.graph.inserting_after(node):
                rebuilt = gm.graph.call_function(DTensor.from_local, (node, spec[0], spec[1]),
                                                 {"run_check": False, "shape": spec[2], "stride": spec[3]})
            node.replace_all_uses_with(rebuilt, delete_user_cb=lambda u: u is not rebuilt)
            node.meta["example_value"] = ex._local_tensor
            new_inputs[i] = ex._local_tensor.detach().requires_grad_(ex.requires_grad)
    gm.recompile()
    def fw(g, inputs):
        if rank == 0: out["fw_placeholders"] = len(g.graph.find_nodes(op="placeholder"))
        return make_boxed_func(g.forward)
    compiled = aot_autograd(fw_compiler=fw, bw_compiler=lambda g, i: make_boxed_func(g.forward))(gm, new_inputs)
    def run(*call_args):
        call_args = list(call_args)
        for i in slots:
            alias = call_args[i]._local_tensor.detach().requires_grad_(True)
            aliases.setdefault(i, []).append(alias)
            call_args[i] = alias
        return compiled(*call_args)
    run._slots = slots
    return run

x = batch_of(mesh["dp"].get_local_rank(), 8)
eager = build(mesh, 8)
eager(x).pow(2).mean().backward()
model = build(mesh, 8)
try:
    loss = torch.compile(model, backend=backend)(x).pow(2).mean()
    loss.backward()
    grads = [a[-1].grad for _, a in sorted(aliases.items())]
    eager_grads = [p.grad.to_local() for p in eager.parameters()]
    out["n_grads"] = len(grads)
    out["max_diff"] = max((g - e).abs().max().item() for g, e in zip(grads, eager_grads))
    out["param_grads_none"] = all(p.grad is None for p in model.parameters())
except Exception as err:
    import traceback
    out["error"] = traceback.format_exc()[-3000:]
json.dump(out, open(os.environ["ZINFTEST_OUT"], "w"))
finish_rank()
