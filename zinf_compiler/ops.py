"""The IR vocabulary: ``torch.ops.zinf.*`` custom ops that passes insert into graphs.

Every asynchronous step is a pair: a ``*_start`` op that begins the transfer
and returns a token (a 0-element tensor that only orders the pair), and a
``*_wait`` op that consumes the token.  The schedule pass only moves these
nodes; it never changes what they mean.  Each op calls into the runtime
store by parameter *slot*: the parameter's position among the Dynamo graph's
inputs, resolved at run time against the parameters of the call in progress
(:mod:`zinf_compiler.runtime.binding`), so one compiled graph serves every
module Dynamo hands it.  Each op has a fake kernel for tracing, and ops that
return nothing are marked side-effecting so that dead code elimination keeps
them.
"""

from __future__ import annotations

import torch

from zinf_compiler.runtime import binding
from zinf_compiler.runtime.comm import COMM
from zinf_compiler.runtime.store import STORE


def _record(slot: int):
    return binding.current().record(slot)


def _token(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=like.device)


def _tile(tile: int) -> int | None:
    """Ops take ``tile=-1`` for the whole parameter, else the row tile (of a tiled parameter) they move."""
    return None if tile < 0 else tile


@torch.library.custom_op("zinf::nc_start", mutates_args=())
def nc_start(param: torch.Tensor, slot: int, tile: int = -1) -> torch.Tensor:
    """Begin reading the parameter in ``slot``'s shard from NVMe into a pinned CPU buffer (for ``tile``, if >= 0)."""
    STORE.nc_start(_record(slot), _tile(tile))
    return _token(param)


@torch.library.custom_op("zinf::nc_wait", mutates_args=())
def nc_wait(token: torch.Tensor, slot: int, tile: int = -1) -> torch.Tensor:
    """Finish the NVMe read; returns a token ordering the CPU-to-device copy after it."""
    STORE.nc_wait(_record(slot), _tile(tile))
    return _token(token)


@torch.library.custom_op("zinf::cg_start", mutates_args=())
def cg_start(after: torch.Tensor, slot: int, tile: int = -1) -> torch.Tensor:
    """Begin copying the parameter in ``slot``'s shard (or its slice of ``tile``) from CPU memory to the device."""
    STORE.cg_start(_record(slot), _tile(tile))
    return _token(after)


@torch.library.custom_op("zinf::cg_wait", mutates_args=())
def cg_wait(token: torch.Tensor, slot: int, tile: int = -1) -> torch.Tensor:
    """Finish the copy; the shard is staged on the device for the gather."""
    STORE.cg_wait(_record(slot), _tile(tile))
    return _token(token)


@torch.library.custom_op("zinf::gather_start", mutates_args=())
def gather_start(param: torch.Tensor, slot: int, after: torch.Tensor | None = None, tile: int = -1) -> torch.Tensor:
    """Begin assembling the full the parameter in ``slot`` (``param`` is its storage-less placeholder).

    ``after``: the token of the fetch (cg) that staged the shard, if any.
    ``tile`` >= 0: assemble only that row tile of a tiled parameter.
    """
    STORE.gather_start(_record(slot), _tile(tile))
    return _token(param)


for _token_op in (nc_start, nc_wait, cg_start, cg_wait, gather_start):
    _token_op.register_fake(lambda first, *rest: first.new_empty(0, dtype=torch.uint8))


@torch.library.custom_op("zinf::gather_wait", mutates_args=())
def gather_wait(token: torch.Tensor, param: torch.Tensor, slot: int, tile: int = -1, tile_rows: int = 0) -> torch.Tensor:
    """Finish the gather started with ``token``: the full parameter, shaped like ``param``.

    ``tile`` >= 0: only that row tile, ``tile_rows`` rows of ``param``.
    """
    return STORE.gather_wait(_record(slot), _tile(tile))


@gather_wait.register_fake
def _(token, param, slot, tile=-1, tile_rows=0):
    if tile >= 0:
        return param.new_empty((tile_rows,) + tuple(param.shape[1:]))
    return torch.empty_like(param, memory_format=torch.contiguous_format)


@torch.library.custom_op("zinf::release", mutates_args=())
def release(gathered: torch.Tensor, slot: int, tile: int = -1) -> None:
    """The last use of a gathered parameter (or tile) has run: its bytes stop counting as held."""
    STORE.release(_record(slot), _tile(tile))


@release.register_fake
def _(gathered, slot, tile=-1):
    return None


@torch.library.custom_op("zinf::reduce_grad_start", mutates_args=())
def reduce_grad_start(grad: torch.Tensor, slot: int, tile: int = -1) -> torch.Tensor:
    """Begin reducing the parameter in ``slot``'s gradient (of row ``tile``, if >= 0) over ranks into its owning shard."""
    STORE.reduce_grad_start(_record(slot), grad, _tile(tile))
    return _token(grad)


@reduce_grad_start.register_fake
def _(grad, slot, tile=-1):
    return grad.new_empty(0, dtype=torch.uint8)


@torch.library.custom_op("zinf::reduce_grad_wait", mutates_args=())
def reduce_grad_wait(token: torch.Tensor, slot: int, tile: int = -1) -> None:
    """Finish the reduce started with ``token``; the result is in the store's gradient shard."""
    STORE.reduce_grad_wait(_record(slot), _tile(tile))


@reduce_grad_wait.register_fake
def _(token, slot, tile=-1):
    return None


@torch.library.custom_op("zinf::all_reduce_grad", mutates_args=())
def all_reduce_grad(grad: torch.Tensor) -> torch.Tensor:
    """Stage 0 (plain data parallel): the gradient averaged over ranks."""
    averaged = grad.clone()
    COMM.all_reduce_avg(averaged).wait()
    return averaged


@all_reduce_grad.register_fake
def _(grad):
    return torch.empty_like(grad)


for _op in (release, reduce_grad_wait):
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
START_TO_WAIT = {NC_START: NC_WAIT, CG_START: CG_WAIT, GATHER_START: GATHER_WAIT, REDUCE_GRAD_START: REDUCE_GRAD_WAIT}
