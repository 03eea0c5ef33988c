"""What a model and its optimizer hold, as the checkpoint sees them: names, buffers, meshes, the optimizer's kind."""

from __future__ import annotations

import torch

from .. import tensor_parallel
from ..api import unwrap
from ..optim import ZinfOptimizer
from ..runtime.checkpoint_files import ZinfCheckpointError
from ..runtime.model_group import ModelView
from ..runtime.store import ParamRecord


def spanning_meshes(view: ModelView, model: torch.nn.Module, what: str, comm=None) -> dict:
    """The meshes the model's sharded parameters use: ``{None or id(mesh): (a parameter's name, mesh or None)}``
    (None: the default group's ranks).  A mesh over only some of the ranks is refused naming the parameter:
    all ranks call save, load and export.  A tensor-parallel model's data-parallel mesh (``mesh["dp"]``) spans
    every rank together with its tp mesh.  ``comm``: the ranks that save (default every rank; a pipeline
    stage's)."""
    comm = comm or view.comm
    meshes = {}
    tp_mesh = tp_mesh_of(model)
    tp_size = tp_mesh.size() if tp_mesh is not None else 1
    for _, param in named_params(model):
        record = view.lookup(param)
        if record is None:
            continue
        if record.mesh.is_default:
            meshes.setdefault(None, (record.name, None))
            continue
        if tp_mesh is not None and record.mesh.replicate is not None:
            raise ZinfCheckpointError(f"zinf.{what}: parameter {record.name} is sharded over {record.mesh.describe()} "
                                      f"(option mesh: HSDP) beside tensor parallelism; checkpoints of a tp model "
                                      f"take a 1-D data-parallel mesh (mesh[\"dp\"])")
        if record.mesh.everyone.world_size * tp_size != comm.world_size:
            raise ZinfCheckpointError(
                f"zinf.{what}: parameter {record.name} is sharded over {record.mesh.describe()} (option mesh), which "
                f"spans {record.mesh.everyone.world_size} of the {comm.world_size} ranks; checkpoints "
                f"need a mesh over every rank. zinf.full_state_dict(model) gathers every weight on every rank of the "
                f"mesh (save it from one rank with torch.save; load it with model.load_state_dict)")
        meshes.setdefault(id(record.mesh), (record.name, record.mesh))
    return meshes


def model_mesh(view: ModelView, model: torch.nn.Module, what: str, comm=None):
    """The one mesh the model's parameters are sharded over (None: the default group's ranks).

    Checkpoint files are numbered by the ranks of that one mesh: parameters
    sharded over different ones (or some over a mesh, some over every rank)
    are refused naming two of them.
    """
    meshes = spanning_meshes(view, model, what, comm)
    if len(meshes) > 1:
        (first, mesh), (second, other) = list(meshes.values())[:2]
        describe = lambda m: m.describe() if m is not None else "every rank"  # noqa: E731
        raise ZinfCheckpointError(f"zinf.{what}: parameters {first} and {second} are sharded over different meshes "
                                  f"({describe(mesh)}, {describe(other)}); save each model on its own")
    return next(iter(meshes.values()))[1] if meshes else None


def tp_mesh_of(model: torch.nn.Module):
    """The model's tensor-parallel DeviceMesh (None: no DTensor parameter)."""
    return tensor_parallel.model_tp_mesh(param for _, param in named_params(model))


def tp_meta(tp_mesh, world_size: int) -> dict:
    """The tp x dp layout a checkpoint was saved at (``meta["tp"]``)."""
    return {"tp": tp_mesh.size(), "dp": world_size // tp_mesh.size()}


def named_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The model's parameters by name (the module or its ``torch.compile`` wrapper)."""
    return list(unwrap(model).named_parameters())  # tied parameters once, under their first name


def named_buffers(model: torch.nn.Module, param_ids: set[int]) -> list[tuple[str, torch.Tensor]]:
    """Persistent buffers (what ``state_dict`` holds besides parameters), once each."""
    seen, buffers = set(), []
    for name, tensor in unwrap(model).state_dict(keep_vars=True).items():
        if id(tensor) not in param_ids and id(tensor) not in seen and isinstance(tensor, torch.Tensor):
            seen.add(id(tensor))
            buffers.append((name, tensor))
    return buffers


def sharded(record: ParamRecord | None) -> bool:
    """Whether the parameter's truth is this rank's slice (stage 1-3), not a full tensor every rank holds."""
    return record is not None and record.stage > 0


def check_optimizer(optimizer) -> None:
    """Refuse an optimizer that is not zinf's (its state is not where a checkpoint reads it)."""
    if not isinstance(optimizer, ZinfOptimizer):
        raise TypeError(f"zinf.save/load take a zinf optimizer (zinf_compiler.optim.AdamW, Adam or SGD), not "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")


def counts_steps(optimizer) -> bool:
    """Whether the optimizer's state holds a step count beside its moments (Adam does; SGD's momentum not)."""
    return issubclass(getattr(optimizer, "inner_class", object), (torch.optim.Adam, torch.optim.AdamW))
