"""A unit's collectives as plain functions of the unit, its tensors and a group of ranks.

The store decides when (its transfer states and byte accounting); these say
what moves: how a unit's gathered matrix is assembled from each rank's local
input, and how its gradients are averaged into each rank's slices (see
:mod:`.units` for the matrix layout).  Nothing here keeps state.
"""

from __future__ import annotations

import torch

from .comm import DONE, Comm, MeshComm
from .units import Unit


def start_gather(unit: Unit, local_parts: list[torch.Tensor], group: Comm, timeout: float | None):
    """Start assembling ``unit``'s gathered matrix on ``group`` from this rank's local input, given in
    ``local_parts`` (its pieces' slices side by side, in one tensor or several).

    All-gather partitions gather every rank's row; broadcast partitions send
    the owner's whole matrix.  Returns ``(work, matrix)``: the matrix is valid
    once ``work.wait()`` returns; for a unit whose values are apart (``Unit.values_apart``: world size
    1's bucket) ``matrix`` is the list of the pieces' flat values instead.
    """
    if unit.values_apart:
        # World size 1's bucket: each piece's value its own tensor, copied from its part (one work).
        values = [torch.empty(piece.numel, dtype=unit.compute_dtype, device=unit.device) for piece in unit.pieces]
        parts = local_parts if len(local_parts) == len(values) else _split(local_parts, unit)
        return group.copy_apart(values, [part[: value.numel()] for part, value in zip(parts, values)],
                                f"all_gather of {unit.name}"), values
    matrix = torch.empty(unit.rows * unit.columns, dtype=unit.compute_dtype, device=unit.device)
    if unit.partition == "allgather" and group.rooted_collectives:
        # Joined straight into this rank's own row (one copy), which the rooted all-gather sends as it is.
        local = torch.cat(local_parts, out=matrix.view(unit.rows, unit.columns)[group.rank])
    else:
        local = local_parts[0] if len(local_parts) == 1 else torch.cat(local_parts)
    if unit.partition == "allgather":
        work = group.all_gather_into(matrix, local, f"all_gather of {unit.name}", timeout=timeout)
    else:
        if local.numel():
            matrix.copy_(local)
        work = group.broadcast(matrix, src=unit.pieces[0].layout.owner, what=f"broadcast of {unit.name}",
                               timeout=timeout)
    return work, matrix


def _split(local_parts: list[torch.Tensor], unit: Unit) -> list[torch.Tensor]:
    """The pieces' local slices, cut from local input given side by side (in one tensor or several)."""
    local = local_parts[0] if len(local_parts) == 1 else torch.cat(local_parts)
    return list(local.split([piece.local_numel for piece in unit.pieces]))


def padded_rows(unit: Unit, flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """At world size 1 (nothing to average): each piece's flat gradient laid out as its row of the matrix.

    A piece whose one segment covers its whole width is passed as it is.
    """
    rows = []
    for piece, flat in zip(unit.pieces, flats):
        if not piece.fills_its_columns:
            padded = torch.zeros(piece.width, dtype=torch.float32, device=unit.device)
            piece.scatter(flat, padded.view(1, -1))
            flat = padded
        rows.append(flat)
    return rows


def start_reduce(unit: Unit, flats: list[torch.Tensor], group: Comm, timeout: float | None):
    """Start averaging the pieces' flat gradients over ``group`` into this rank's row of ``unit``'s matrix.

    All-gather partitions reduce-scatter (averaged); broadcast partitions sum
    onto the owner (:func:`finish_reduce` divides).  Returns ``(work, out)``:
    ``out`` (this rank's row, or the owner's whole matrix) is valid once
    ``work.wait()`` returns.
    """
    # Not zeroed first where each piece zeroes its own padding (a memset of the whole gradient saved).
    allocate = torch.empty if all(piece.pads_itself for piece in unit.pieces) else torch.zeros
    matrix = allocate(unit.rows * unit.columns, dtype=unit.compute_dtype, device=unit.device)
    for index, (piece, flat) in enumerate(zip(unit.pieces, flats)):
        piece.scatter(flat, unit.column_block(matrix, index))
    if unit.rows > 1:
        out = torch.empty(unit.columns, dtype=unit.compute_dtype, device=unit.device)
        work = group.reduce_scatter_avg(out, matrix, f"reduce_scatter of the gradient of {unit.name}",
                                        timeout=timeout)
        return work, out
    if unit.world_size > 1:  # broadcast partition: summed on the owner
        work = group.reduce_sum(matrix, dst=unit.pieces[0].layout.owner,
                                what=f"reduce of the gradient of {unit.name}", timeout=timeout)
        return work, matrix
    return DONE, matrix  # one row at world size 1 (fp16, or broadcast): nothing to average


def finish_reduce(unit: Unit, out: torch.Tensor, mesh: MeshComm, timeout: float | None) -> torch.Tensor | None:
    """This rank's averaged row once :func:`start_reduce`'s work is done; None where the rank keeps none.

    Broadcast partitions: the owner's sum divided by the shard group's size
    (other ranks keep nothing).  With replicas (HSDP), the row is then
    averaged across the replicas that hold the same slice.
    """
    if unit.partition == "broadcast":
        if unit.pieces[0].layout.rank != unit.pieces[0].layout.owner:
            return None
        if unit.world_size > 1:
            out = out / unit.world_size
    mesh.average_replicas(out, f"all_reduce of the gradient of {unit.name} across replicas", timeout)
    return out
