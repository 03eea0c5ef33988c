"""A unit's collectives (runtime/collectives.py) over a world simulated in one process (issue 27).

Every rank's side runs in turn against a recording group; the world then does
what the collectives would (gather rows, average, sum to the owner, send the
owner's matrix).  Drawn layouts: buckets of whole parameters, a whole tiled
parameter, one row tile of one; world sizes 1-4; both partitions.  What must
hold: every rank assembles each parameter (or tile) exactly, and each rank's
reduced row holds the average gradient at the elements its shard owns.
"""

from __future__ import annotations

import dataclasses

from unittest import mock

import torch
from hypothesis import given, settings, strategies as st

from zinf_compiler.runtime.collectives import finish_reduce, padded_rows, start_gather, start_reduce
from zinf_compiler.runtime.comm import DONE
from zinf_compiler.runtime.param_plan import plan_param
from zinf_compiler.runtime.units import ParamLayout, unit_of


class _SimulatedWorld:
    """Records each rank's collectives in order; :meth:`complete` carries them out together."""

    def __init__(self, size: int):
        self.size = size
        self.calls: list[list[tuple]] = [[] for _ in range(size)]

    def group(self, rank: int, rooted: bool = False) -> "_RankGroup":
        return _RankGroup(self, rank, rooted)

    def complete(self) -> None:
        for calls in zip(*self.calls, strict=True):
            kind = calls[0][0]
            assert all(call[0] == kind for call in calls), "ranks called different collectives"
            if kind == "all_gather":
                gathered = torch.cat([local for _, _, local in calls])
                for _, output, _ in calls:
                    output.copy_(gathered)
            elif kind == "reduce_scatter":
                average = sum(full for _, _, full in calls) / self.size
                for rank, (_, output, _) in enumerate(calls):
                    output.copy_(average.view(self.size, -1)[rank])
            elif kind == "broadcast":
                source = calls[0][2]
                sent = calls[source][1].clone()
                for _, tensor, _ in calls:
                    tensor.copy_(sent)
            elif kind == "reduce":
                destination = calls[0][2]
                total = sum(tensor for _, tensor, _ in calls)
                calls[destination][1].copy_(total)
        self.calls = [[] for _ in range(self.size)]


@dataclasses.dataclass
class _RankGroup:
    world: _SimulatedWorld
    rank: int
    rooted_collectives: bool = False  # as on gloo: start_gather places the local input in the rank's own row

    def all_gather_into(self, output, local, what="", timeout=None):
        self.world.calls[self.rank].append(("all_gather", output, local.clone()))
        return DONE

    def reduce_scatter_avg(self, output, full, what="", timeout=None):
        self.world.calls[self.rank].append(("reduce_scatter", output, full.clone()))
        return DONE

    def broadcast(self, tensor, src, what="", timeout=None):
        self.world.calls[self.rank].append(("broadcast", tensor, src))
        return DONE

    def reduce_sum(self, tensor, dst, what="", timeout=None):
        self.world.calls[self.rank].append(("reduce", tensor, dst))
        return DONE


class _NoReplicas:
    """The mesh of a model without replicas: averaging across them does nothing."""

    def average_replicas(self, tensor, what, timeout=None):
        return None


def _layout(uid: int, shape, world: int, rank: int, partition: str, tile_rows=None) -> ParamLayout:
    return ParamLayout(name=f"p{uid}", plan=plan_param(
        uid=uid, device=torch.device("cpu"), shape=shape, dtype=torch.float32, stage=3, partition=partition,
        param_dtype=torch.float32,
        world_size=world, rank=rank, owner=0 if partition == "broadcast" else None, param_tier="device",
        opt_tier="device", tile_rows=tile_rows))


def _shard(layout: ParamLayout, full: torch.Tensor) -> torch.Tensor:
    """This rank's flat shard of ``full``, from the elements its layout says it owns (padding zero)."""
    shard = torch.zeros(max(layout.local_numel, 0))
    flat = full.reshape(-1)
    for first, stop, local_start in layout.owned_ranges():
        shard[local_start : local_start + stop - first] = flat[first:stop]
    return shard


@st.composite
def _units(draw):
    """(world size, kind, shapes, tile rows or None, tile index or None, partition)."""
    world = draw(st.integers(1, 4))
    kind = draw(st.sampled_from(["bucket", "tiled", "tile"]))
    partition = "allgather" if kind == "bucket" and world > 1 else draw(st.sampled_from(["allgather", "broadcast"]))
    dims = st.lists(st.integers(1, 5), min_size=1, max_size=3)
    if kind == "bucket":
        count = 1 if partition == "broadcast" else draw(st.integers(1, 3))
        return world, kind, [draw(dims) for _ in range(count)], None, None, partition
    rows = draw(st.integers(2, 7))
    shape = [rows] + draw(st.lists(st.integers(1, 4), max_size=2))
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), min_size=1, max_size=rows - 1)))
    tile_rows = tuple(b - a for a, b in zip([0, *cuts], [*cuts, rows]))
    tile = draw(st.integers(0, len(tile_rows) - 1)) if kind == "tile" else None
    return world, kind, [shape], tile_rows, tile, partition


_REAL_EMPTY = torch.empty


def _garbage_empty(*args, **kwargs):
    """torch.empty that never happens to hand out zeros: NaN where a float tensor's contents are undefined."""
    tensor = _REAL_EMPTY(*args, **kwargs)
    return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor


@settings(max_examples=150, deadline=None, derandomize=True)
@given(_units(), st.integers(0, 2**16), st.booleans())
def test_every_rank_assembles_the_values_and_reduces_the_average_into_what_it_owns(drawn, seed, rooted):
    with mock.patch.object(torch, "empty", _garbage_empty):
        _check_assembles_and_reduces(drawn, seed, rooted)


def _check_assembles_and_reduces(drawn, seed, rooted):
    world, kind, shapes, tile_rows, tile, partition = drawn
    generator = torch.Generator().manual_seed(seed)
    values = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(world)]
    simulated = _SimulatedWorld(world)
    units = [unit_of([_layout(uid, shape, world, rank, partition, tile_rows) for uid, shape in enumerate(shapes)],
                     tile) for rank in range(world)]

    def expected_value(index: int) -> torch.Tensor:
        if tile is None:
            return values[index]
        start, stop = units[0].pieces[0].layout.tile_row_range(tile)
        return values[index][start:stop]

    # Gather: each rank's local input is its pieces' slices of its shard, side by side.
    started = []
    for rank, unit in enumerate(units):
        local = [_shard(piece.layout, values[index])[piece.local_range[0] : piece.local_range[1]]
                 for index, piece in enumerate(unit.pieces)]
        assert sum(part.numel() for part in local) == unit.local_numel
        started.append(start_gather(unit, local, simulated.group(rank, rooted), None))
    simulated.complete()
    for unit, (work, matrix) in zip(units, started):
        work.wait()
        for index, piece in enumerate(unit.pieces):
            assert torch.equal(piece.assemble(unit.column_block(matrix, index)), expected_value(index))

    # Reduce: the average over ranks of each piece's gradient, at the elements this rank owns.
    outs = []
    for rank, unit in enumerate(units):
        flats = [grads[rank][index].reshape(-1) if tile is None else
                 grads[rank][index][slice(*unit.pieces[0].layout.tile_row_range(tile))].reshape(-1)
                 for index in range(len(unit.pieces))]
        if unit.sizes.reduce == 0:  # world size 1: added into the shard at once
            outs.append(torch.cat(padded_rows(unit, flats)))
            continue
        outs.append(start_reduce(unit, flats, simulated.group(rank), None))
    simulated.complete()
    covered = [torch.zeros(value.numel(), dtype=torch.bool) for value in values]  # over all ranks
    for rank, (unit, out) in enumerate(zip(units, outs)):
        if isinstance(out, tuple):
            work, out = out
            work.wait()
            out = finish_reduce(unit, out, _NoReplicas(), None)
        if out is None:
            assert partition == "broadcast" and rank != 0  # a broadcast parameter's gradient is the owner's
            continue
        for index, piece in enumerate(unit.pieces):
            average = (sum(grads[r][index] for r in range(world)) / world).reshape(-1)
            row = out.reshape(-1)[unit.offsets[index] : unit.offsets[index] + piece.width]
            # The piece's columns are its window of the shard: local positions [base, base + width).
            base = piece.local_range[0]
            padding = torch.ones(piece.width, dtype=torch.bool)  # positions holding no element
            for first, stop, local_start in piece.layout.owned_ranges():
                low, high = max(local_start, base), min(local_start + stop - first, base + piece.width)
                if low >= high:
                    continue  # another tile's slice
                elements = slice(first + low - local_start, first + high - local_start)
                torch.testing.assert_close(row[low - base : high - base], average[elements])
                padding[low - base : high - base] = False
                assert not covered[index][elements].any(), "two ranks own one element"
                covered[index][elements] = True
            # Padding averages to zero (a gradient norm over the shard counts it).
            assert torch.equal(row[padding], torch.zeros_like(row[padding])), row
    for index, mask in enumerate(covered):
        if tile is None:
            assert mask.all(), "an element no rank reduced"
        else:
            rows = units[0].pieces[0].layout.tile_row_range(tile)
            row_numel = values[index][0].numel()
            assert mask[rows[0] * row_numel : rows[1] * row_numel].all(), "an element of the tile no rank reduced"


def test_the_simulated_world_notices_ranks_that_call_different_collectives():
    simulated = _SimulatedWorld(2)
    simulated.group(0).all_gather_into(torch.zeros(2), torch.zeros(1))
    simulated.group(1).reduce_sum(torch.zeros(2), 0)
    try:
        simulated.complete()
    except AssertionError as err:
        assert "different collectives" in str(err)
    else:
        raise AssertionError("a mismatch went unnoticed")
