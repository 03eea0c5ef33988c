"""The IR vocabulary: ``torch.ops.zinf.*`` custom ops that passes insert into graphs.

Every asynchronous step is a pair: a ``*_start`` op that begins the transfer
and returns a token (a 0-element tensor that only orders the pair), and a
``*_wait`` op that consumes the token.  The schedule pass only moves these
nodes; it never changes what they mean.  Each op moves one *unit*
(:mod:`zinf_compiler.runtime.units`: a bucket of parameters, one parameter, or
one row tile of one) and names its parameters by *slot*: their positions among
the Dynamo graph's inputs, resolved at run time against the parameters of the
call in progress (:mod:`zinf_compiler.runtime.binding`, which also names the store holding them), so one compiled graph
serves every module Dynamo hands it.  Each op has a fake kernel for tracing; ops that
return nothing, and starts that take no tensor (nothing a compiler could fold
or merge them by), are marked side-effecting so that they are kept as placed.
"""

from __future__ import annotations

import torch

from zinf_compiler.runtime import binding


def _bound(slots: list[int], tile: int):
    """The store of the call in progress and its unit for ``slots`` (a bucket, or one parameter).

    ``tile=-1``: whole parameters; else that row tile of the one parameter in ``slots``.
    """
    call = binding.current()
    return call.store, call.unit(slots, None if tile < 0 else tile)


def _token(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device)


# No op takes a stage-3 parameter itself as an input: between uses its storage
# holds nothing, and a compiler pass that reads an op's inputs (Inductor's
# channels-last layout for a convolution's weight copied the parameter before
# its gather) would read freed memory.  The ops name parameters by slot and take
# their device, shapes and dtype as plain arguments; only gathered values,
# gradients and tokens flow between nodes.  (The verifier checks this.)


@torch.library.custom_op("zinf::nc_start", mutates_args=())
def nc_start(slots: list[int], device: torch.device, tile: int = -1) -> torch.Tensor:
    """Begin reading the shards of the parameters in ``slots`` (or of one's ``tile``) from NVMe into a pinned buffer.

    ``device``: the parameters' device (the token's).
    """
    store, unit = _bound(slots, tile)
    store.nc_start(unit)
    return _token(device)


@nc_start.register_fake
def _(slots, device, tile=-1):
    return torch.empty(0, dtype=torch.uint8, device=device)


def _finish_op(name: str, doc: str):
    """A ``zinf::<name>`` op that finishes a host-side step (nc or cg) of ``slots``' unit and passes a token on.

    The store's method of the same name does the work; the op returns a fresh
    token on the consumed token's device that orders the next step after it.
    """

    def finish(token: torch.Tensor, slots: list[int], tile: int = -1) -> torch.Tensor:
        store, unit = _bound(slots, tile)
        getattr(store, name)(unit)
        return _token(token.device)

    finish.__doc__ = doc
    finish_op = torch.library.custom_op(f"zinf::{name}", finish, mutates_args=())
    finish_op.register_fake(lambda token, slots, tile=-1: token.new_empty(0, dtype=torch.uint8))
    return finish_op


nc_wait = _finish_op("nc_wait", "Finish the NVMe read; returns a token ordering the CPU-to-device copy after it.")


@torch.library.custom_op("zinf::cg_start", mutates_args=())
def cg_start(slots: list[int], device: torch.device, after: torch.Tensor | None = None,
             tile: int = -1) -> torch.Tensor:
    """Begin copying the shards of ``slots`` (or their slice of ``tile``) from CPU memory to the device.

    ``after``: the token of the NVMe read (nc) that staged them, if any.
    """
    store, unit = _bound(slots, tile)
    store.cg_start(unit)
    return _token(device)


cg_wait = _finish_op("cg_wait", "Finish the copy; the shards are staged on the device for the gather.")


@torch.library.custom_op("zinf::gather_start", mutates_args=())
def gather_start(slots: list[int], device: torch.device, after: torch.Tensor | None = None,
                 tile: int = -1) -> torch.Tensor:
    """Begin assembling the full parameters in ``slots`` with one collective.

    ``after``: the token of the fetch (cg) that staged the shards, if any.
    ``tile`` >= 0: assemble only that row tile of the one tiled parameter.
    """
    store, unit = _bound(slots, tile)
    store.gather_start(unit)
    return _token(device)


for _token_op in (cg_start, gather_start):
    _token_op.register_fake(lambda slots, device, after=None, tile=-1: torch.empty(0, dtype=torch.uint8,
                                                                                    device=device))


@torch.library.custom_op("zinf::gather_wait", mutates_args=())
def gather_wait(token: torch.Tensor, slots: list[int], sizes: list[int], dims: list[int],
                dtype: torch.dtype, tile: int = -1) -> list[torch.Tensor]:
    """Finish the gather started with ``token``: the full parameters (or ``tile``: that row tile of the one).

    Their shapes, for tracing: ``dims[i]`` sizes each, one after another in
    ``sizes``; all of ``dtype`` (one bucket holds one dtype), on the token's device.
    """
    store, unit = _bound(slots, tile)
    return store.gather_wait(unit)


@gather_wait.register_fake
def _(token, slots, sizes, dims, dtype, tile=-1):
    return [torch.empty(shape, dtype=dtype, device=token.device) for shape in split_shapes(sizes, dims)]


def split_shapes(sizes: list[int], dims: list[int]) -> list[list[int]]:
    """``gather_wait``'s shapes: ``dims[i]`` sizes each, one after another in ``sizes``."""
    shapes, at = [], 0
    for ndim in dims:
        shapes.append(list(sizes[at : at + ndim]))
        at += ndim
    return shapes


@torch.library.custom_op("zinf::release", mutates_args=())
def release(gathered: list[torch.Tensor], slots: list[int], tile: int = -1) -> None:
    """The last use of the gathered parameters (or tile) has run: their bytes stop counting as held."""
    store, unit = _bound(slots, tile)
    store.release(unit)


@torch.library.custom_op("zinf::reduce_grad_start", mutates_args=())
def reduce_grad_start(grads: list[torch.Tensor], slots: list[int], tile: int = -1) -> torch.Tensor:
    """Begin reducing the gradients of the parameters in ``slots`` (of row ``tile``, if >= 0) with one collective."""
    store, unit = _bound(slots, tile)
    store.reduce_grad_start(unit, grads)
    return _token(grads[0].device)


@reduce_grad_start.register_fake
def _(grads, slots, tile=-1):
    return grads[0].new_empty(0, dtype=torch.uint8)


@torch.library.custom_op("zinf::reduce_grad_wait", mutates_args=())
def reduce_grad_wait(token: torch.Tensor, slots: list[int], tile: int = -1) -> None:
    """Finish the reduce started with ``token``; the results are in the store's gradient shards."""
    store, unit = _bound(slots, tile)
    store.reduce_grad_wait(unit)


# Both return nothing, and so do their fakes.
for _finishing_op in (release, reduce_grad_wait):
    _finishing_op.register_fake(lambda *args, **kwargs: None)


@torch.library.custom_op("zinf::all_reduce_grad", mutates_args=())
def all_reduce_grad(grad: torch.Tensor) -> torch.Tensor:
    """Stage 0 (plain data parallel): the gradient averaged over ranks."""
    averaged = grad.clone()
    binding.current().store.comm.all_reduce_avg(averaged).wait()  # the default group's (every rank)
    return averaged


@all_reduce_grad.register_fake
def _(grad):
    return torch.empty_like(grad)


def _model_ledger():
    """The ledger of the model whose call is running (None at stage 0: no parameters are bound)."""
    return binding.current().model_ledger()


def _activations():
    """The activation store of the call running (runtime/activations.py), handed to it by the backend."""
    return binding.current().activations


@torch.library.custom_op("zinf::act_offload_start", mutates_args=())
def act_offload_start(value: torch.Tensor, tier: str, nvme_path: str, name: str) -> torch.Tensor:
    """Begin copying a saved activation off the device (``tier``: "cpu" or "nvme"); returns its handle.

    The forward graph saves the handle (16 bytes of CPU memory with ``value``'s shape and dtype, every
    stride 0) for backward instead of ``value``.
    """
    return _activations().offload_start(value, tier, nvme_path, name, _model_ledger())


def handle_like(value: torch.Tensor) -> torch.Tensor:
    """The fake of a handle for ``value`` (under the fake mode in force)."""
    return torch.empty_strided(value.shape, [0] * value.dim(), dtype=value.dtype, device="cpu")


@act_offload_start.register_fake
def _(value, tier, nvme_path, name):
    return handle_like(value)


@torch.library.custom_op("zinf::act_offload_wait", mutates_args=())
def act_offload_wait(handle: torch.Tensor, value: torch.Tensor) -> None:
    """The activation's copy off the device is done (``value``: read last here, so freed after)."""
    _activations().offload_wait(handle)


@act_offload_wait.register_fake
def _(handle, value):
    return None


@torch.library.custom_op("zinf::act_fetch_start", mutates_args=())
def act_fetch_start(handle: torch.Tensor) -> torch.Tensor:
    """Begin bringing a saved activation back to the device (backward); returns a token."""
    _activations().fetch_start(handle)
    return torch.empty(0, dtype=torch.uint8)


@act_fetch_start.register_fake
def _(handle):
    return handle.new_empty(0, dtype=torch.uint8)


@torch.library.custom_op("zinf::act_fetch_wait", mutates_args=())
def act_fetch_wait(token: torch.Tensor, handle: torch.Tensor, shape: list[int], stride: list[int],
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Finish the fetch: the activation, with the shape, strides and dtype it was saved with."""
    return _activations().fetch_wait(handle)


@act_fetch_wait.register_fake
def _(token, handle, shape, stride, dtype, device):
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


for _op in (nc_start, cg_start, gather_start, release, reduce_grad_wait, act_offload_wait):
    torch.fx.has_side_effect(_op._opoverload)

NC_START = torch.ops.zinf.nc_start.default
NC_WAIT = torch.ops.zinf.nc_wait.default
CG_START = torch.ops.zinf.cg_start.default
CG_WAIT = torch.ops.zinf.cg_wait.default
GATHER_START = torch.ops.zinf.gather_start.default
GATHER_WAIT = torch.ops.zinf.gather_wait.default
RELEASE = torch.ops.zinf.release.default
REDUCE_GRAD_START = torch.ops.zinf.reduce_grad_start.default
REDUCE_GRAD_WAIT = torch.ops.zinf.reduce_grad_wait.default
ALL_REDUCE_GRAD = torch.ops.zinf.all_reduce_grad.default
ACT_OFFLOAD_START = torch.ops.zinf.act_offload_start.default
ACT_OFFLOAD_WAIT = torch.ops.zinf.act_offload_wait.default
ACT_FETCH_START = torch.ops.zinf.act_fetch_start.default
ACT_FETCH_WAIT = torch.ops.zinf.act_fetch_wait.default
START_TO_WAIT = {NC_START: NC_WAIT, CG_START: CG_WAIT, GATHER_START: GATHER_WAIT, REDUCE_GRAD_START: REDUCE_GRAD_WAIT,
                 ACT_OFFLOAD_START: ACT_OFFLOAD_WAIT, ACT_FETCH_START: ACT_FETCH_WAIT}


def arg(node, name: str):
    """A zinf op node's argument by its schema name (``slots``, ``tile``, ``after``, ...), not by position."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if index < len(node.args):
                return node.args[index]
            return node.kwargs.get(name, argument.default_value if argument.has_default_value() else None)
    raise KeyError(f"{node.target} has no argument {name!r}")


def tile_of(node) -> int | None:
    """The row tile a zinf op moves, or None for whole parameters."""
    tile = arg(node, "tile")
    return None if tile is None or tile < 0 else tile
