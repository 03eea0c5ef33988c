"""Tensor-parallel models for zinf: DTensor parameters become plain parameters zinf can shard over "dp".

SPIKE (issue 37, approach B; see /work/notes/tp_spike.md).  torch's ``parallelize_module`` leaves each
parallelized parameter a DTensor on the "tp" mesh.  AOTAutograd hands a compiled graph a DTensor input
as its local tensor, but rebuilds a DTensor gradient for it after backward, from a tensor: zinf's
stage 2-3 backward reduces gradients into its shards and returns ``None`` there, which that wrapper
cannot take.  So, as SimpleFSDP does for its own sharding, the parameter the module registers becomes
a plain ``nn.Parameter`` holding the TP-local tensor, and the module's attribute of that name a
property that rebuilds the DTensor (``DTensor.from_local``, no communication) on every read.  Dynamo
traces the property: the graph takes the local tensor as a parameter (adopted, sharded over dp,
gathered and released like any other), and the TP collectives of the DTensor ops stay in the graph as
functional collectives.  The gradient of ``from_local`` is the local gradient in the parameter's
placements (a Partial one all-reduced over tp first), which zinf then reduces over dp.

:func:`localize` must run before ``torch.compile`` traces the model (after ``parallelize_module``).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How one localized parameter lies across the tensor-parallel ranks: what ``from_local`` needs, and
    what a full state dict, an export or a resharding load needs to rebuild the whole tensor."""

    mesh: object  # the DeviceMesh of the tp dimension
    placements: tuple
    shape: torch.Size  # the whole (global) tensor's
    stride: tuple[int, ...]


def layouts_of(module: torch.nn.Module) -> dict[str, TPLayout]:
    """``module``'s own localized parameters by name (empty if :func:`localize` changed none)."""
    return getattr(module, "_zinf_tp_layouts", {})


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that holds ``tensor``'s values on this rank: a DTensor's local tensor, else ``tensor``."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def flat_width(tensor: torch.Tensor) -> int:
    """How many graph inputs AOTAutograd flattens ``tensor`` into: 1 for a plain tensor; for a traceable
    subclass (``__tensor_flatten__``), its inner tensors and opaque objects, recursively (a DTensor: its local
    tensor and its device mesh, 2)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return 1
    attrs, _ = tensor.__tensor_flatten__()
    return sum(flat_width(inner) if isinstance(inner := getattr(tensor, attr), torch.Tensor) else 1 for attr in attrs)


def localize(model: torch.nn.Module) -> dict[str, TPLayout]:
    """Replace every DTensor parameter of ``model`` by a plain parameter holding its local tensor (a copy
    that owns its memory, as zinf's sharding needs), read back through a DTensor-building property.

    Returns the layouts by the parameters' module paths (their state-dict names are unchanged).
    """
    from torch.distributed.tensor import DTensor

    found = {}
    for path, module in model.named_modules():
        names = [name for name, param in module._parameters.items() if isinstance(param, DTensor)]
        if not names:
            continue
        layouts = dict(layouts_of(module))
        for name in names:
            dtensor = module._parameters[name]
            layouts[name] = TPLayout(dtensor.device_mesh, tuple(dtensor.placements), dtensor.shape, dtensor.stride())
            local = torch.nn.Parameter(dtensor.to_local().detach().clone(), requires_grad=dtensor.requires_grad)
            local._zinf_tp_layout = layouts[name]  # (read by check_mesh: zinf sees the parameter, not its module)
            module._parameters[name] = local
            found[f"{path}.{name}" if path else name] = layouts[name]
        module._zinf_tp_layouts = layouts
        if not getattr(type(module), "_zinf_localized", False):
            # A class of its own per module, as torch.nn.utils.parametrize does: the properties must not
            # reach other instances of the user's class.
            module.__class__ = type(type(module).__name__, (type(module),), {"_zinf_localized": True})
        for name in names:
            setattr(type(module), name, property(_dtensor_reader(name)))
    return found


def check_params(params: dict, names: dict, mesh) -> None:
    """Refuse, before adoption, what would train a tensor-parallel model wrongly.

    ``params``: Dynamo position -> parameter; ``names``: position -> its module path; ``mesh``: the
    runtime MeshComm zinf shards over.  A DTensor parameter (not localized) cannot take zinf's ``None``
    gradient; a localized one must not be sharded, nor broadcast at adoption, across its own tp ranks,
    which hold different slices of it (silently wrong: every tp rank would train tp rank 0's slice).
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sharded_over = None
    for position, param in params.items():
        if isinstance(param, DTensor):
            raise ValueError(
                f"zinf: parameter {names[position]} is a DTensor (tensor parallel); call "
                f"zinf_compiler.tensor_parallel.localize(model) after parallelize_module and before torch.compile")
        layout = getattr(param, "_zinf_tp_layout", None)
        if layout is None:
            continue
        if sharded_over is None:  # (only a tensor-parallel model reaches here: torch.distributed is up)
            sharded_over = set(dist.get_process_group_ranks(mesh.everyone.group or dist.group.WORLD))
        tp_ranks = set(dist.get_process_group_ranks(layout.mesh.get_group()))
        if len(tp_ranks & sharded_over) > 1:
            raise ValueError(
                f"zinf: option mesh spans ranks {sorted(tp_ranks & sharded_over)}, which hold different tensor-"
                f"parallel slices of {names[position]}; pass the data-parallel dimension (mesh[\"dp\"])")


def full_tensor(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of ``param`` given ``value``, its TP-local tensor (already whole over dp): gathered
    over the tp ranks (a collective on them) for a localized parameter, ``value`` for any other."""
    layout = getattr(param, "_zinf_tp_layout", None)
    if layout is None:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, layout.mesh, layout.placements, run_check=False, shape=layout.shape,
                              stride=layout.stride).full_tensor()


def _dtensor_reader(name: str):
    def read(module: torch.nn.Module):
        from torch.distributed.tensor import DTensor

        layout = module._zinf_tp_layouts[name]
        return DTensor.from_local(module._parameters[name], layout.mesh, layout.placements, run_check=False,
                                  shape=layout.shape, stride=layout.stride)

    return read
