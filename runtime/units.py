"""Units: what the runtime moves as one piece, and where every element of it sits.

A :class:`ParamLayout` holds the fixed facts of one adopted parameter: its
name and plan (runtime/param_plan.py: its shape, compute device, how it is
split over ranks, whether it is laid out in row tiles, its dtypes, tiers and
swap keys).  They never change after adoption, so the store's records carry
them (``ParamRecord`` is a ``ParamLayout``) and the passes read copies of
them (``layout_of``) to size what they schedule.

A :class:`Unit` is one collective's worth: a whole parameter, one row tile of
a tiled parameter, or a *bucket* of whole parameters moved together (one
all-gather, one reduce-scatter).  Each member is a :class:`Piece`.  The unit
fixes, once:

* the *local input*: each piece's slice of this rank's flat shard
  (``local_start:local_stop``), side by side at ``offsets``; what the cg
  step copies to the device and the all-gather sends;
* the *gathered matrix*: ``rows x columns`` elements, rank-major (one row per
  rank for ``allgather``, one row for ``broadcast``); piece ``i`` owns the
  columns ``offsets[i]:offsets[i] + slice_numel``, and its *segments* say
  which of those elements are which elements of the assembled value (a tiled
  parameter's shard holds a padded slice of every tile);
* the byte sizes every consumer reads (:class:`UnitSizes`): the store's
  transient accounting, the schedule's simulation and caps, the pinned pool.

Nothing here holds state or touches a device beyond the tensors it is given.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .swap_layout import align as _align


class ZinfUnitError(RuntimeError):
    """Parameters that cannot be moved as one unit (different dtypes, devices, tiers or partition)."""


# The plan's facts a layout reads as its own (see ParamLayout).
PLAN_FACTS = ("uid", "shape", "dtype", "device", "compute_dtype", "stage", "partition", "world_size", "rank", "owner",
              "param_tier", "opt_tier", "tile_rows", "tile_align", "bucket_bytes", "shard_numel", "local_numel",
              "gathered_numel", "numel", "holding_dtype", "row_numel", "params_in_master", "shard_is_param",
              "step_in_backward")


@dataclasses.dataclass(eq=False, kw_only=True)
class ParamLayout:
    """One adopted parameter's name and frozen plan (runtime/param_plan.py).

    Every layout fact is the plan's: a layout reads ``shape``, ``shard_numel``,
    ``tile_rows`` and the rest (:data:`PLAN_FACTS`) through it, and computes none.
    """

    name: str
    plan: "ParamPlan"  # the layout, fixed at adoption (runtime/param_plan.py's plan_param)

    @property
    def owns_state(self) -> bool:
        """Whether this rank holds a slice that the optimizer must step."""
        return self.local_numel > 0

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's shard in compute dtype."""
        return self.local_numel * self.compute_dtype.itemsize

    def tile_row_range(self, tile: int) -> tuple[int, int]:
        """The rows [start, stop) of row tile ``tile``."""
        return self.plan.tile_row_range(tile)

    def tile_numel(self, tile: int) -> int:
        """Elements of row tile ``tile``."""
        return self.plan.tile_numel(tile)

    def tile_shard_numel(self, tile: int) -> int:
        """Elements of one rank's slice of ``tile`` (allgather: padded to a multiple of the world size)."""
        return self.plan.tile_shard_numels[tile]

    def tile_slot_numel(self, tile: int) -> int:
        """Elements ``tile`` takes in the local shard: its slice, padded to ``tile_align``."""
        return self.plan.tile_slot_numel(tile)

    def tile_local_range(self, tile: int) -> tuple[int, int]:
        """Where this rank's slice of ``tile`` sits in its flat shard (empty for a non-owner in broadcast mode)."""
        return self.plan.tile_local_ranges[tile]

    def swap_layout(self) -> list[tuple[str, int, int]]:
        """(swap key, first element, elements) of the nvme-tier shard: one key, one per tile, or the master's."""
        return list(self.plan.shard_swap)

    def owned_ranges(self) -> list[tuple[int, int, int]]:
        """Which elements of the flat parameter this rank's shard holds: ``(first, stop, local_start)``.

        Elements ``first:stop`` of the parameter (row-major) sit at
        ``local_start`` in the local shard, master and optimizer moments;
        padding belongs to no range.  What a checkpoint records, so that
        another world size or layout can read it.
        """
        return list(self.plan.local_ranges)


def _plan_fact(name: str) -> property:
    return property(lambda layout: getattr(layout.plan, name), doc=f"The plan's ``{name}`` (runtime/param_plan.py).")


for _name in PLAN_FACTS:
    setattr(ParamLayout, _name, _plan_fact(_name))


def layout_of(layout: ParamLayout) -> ParamLayout:
    """A plain copy of a record's fixed facts (what the passes may hold without holding the record)."""
    return ParamLayout(name=layout.name, plan=layout.plan)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements ``first:first + numel`` of a piece's flat value fill its columns ``column:column + width``
    row-major (each rank's row holds ``width`` of them; the last row's tail is padding)."""

    first: int
    numel: int
    column: int
    width: int


@dataclasses.dataclass(frozen=True, eq=False)
class Piece:
    """One member of a unit: a whole parameter (``tile`` None) or one row tile of one."""

    layout: ParamLayout
    tile: int | None

    @functools.cached_property
    def local_range(self) -> tuple[int, int]:
        """Where the piece's data sits in this rank's flat shard."""
        layout = self.layout
        if self.tile is not None:
            return layout.tile_local_range(self.tile)
        return 0, layout.local_numel

    @property
    def local_numel(self) -> int:
        """Elements of this rank's slice of the piece."""
        start, stop = self.local_range
        return stop - start

    @functools.cached_property
    def width(self) -> int:
        """Columns the piece takes in the gathered matrix (each rank's share, padding included)."""
        layout = self.layout
        if self.tile is not None:
            return layout.tile_shard_numel(self.tile)
        return layout.shard_numel if layout.partition == "allgather" else layout.numel

    @functools.cached_property
    def shape(self) -> torch.Size:
        """Shape of the assembled value."""
        if self.tile is None:
            return self.layout.shape
        return torch.Size((self.layout.tile_rows[self.tile],) + tuple(self.layout.shape[1:]))

    @property
    def numel(self) -> int:
        """Elements of the piece (the parameter, or its tile)."""
        return self.shape.numel()

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        """Where the piece's elements sit in its columns of the gathered matrix: one segment, or one per row tile
        of a whole tiled parameter."""
        layout = self.layout
        if self.tile is not None or layout.tile_rows is None or layout.partition == "broadcast":
            return (Segment(0, self.numel, 0, self.width),)
        # A whole tiled parameter: each tile's padded slice sits at its slot in the shard.
        return tuple(Segment(layout.tile_row_range(tile)[0] * layout.row_numel, layout.tile_numel(tile),
                             layout.tile_local_range(tile)[0], layout.tile_shard_numel(tile))
                     for tile in range(len(layout.tile_rows)))

    @functools.cached_property
    def fills_its_columns(self) -> bool:
        """Whether the piece's flat value is its columns' row as it is: one segment, no padding."""
        return self.segments == (Segment(0, self.numel, 0, self.width),)

    def assemble(self, columns: torch.Tensor) -> torch.Tensor:
        """The piece's value from its columns of the gathered matrix (contiguous; a view where it can be)."""
        parts = [columns[:, s.column : s.column + s.width].reshape(-1)[: s.numel] for s in self.segments]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        return flat.view(self.shape)

    def scatter(self, flat: torch.Tensor, columns: torch.Tensor) -> None:
        """Write the piece's flat value (a gradient) into its columns of a reduce-scatter input.

        Columns that hold no element (padding) must be zero: they are, where
        the piece has one segment (zeroed here); otherwise the caller zeroes
        the input first (see :attr:`pads_itself`).
        """
        for s in self.segments:
            block = columns[:, s.column : s.column + s.width]
            full_rows, rest = divmod(s.numel, s.width)
            source = flat[s.first : s.first + s.numel]
            block[:full_rows].copy_(source[: full_rows * s.width].view(full_rows, s.width))
            if rest:
                block[full_rows, :rest].copy_(source[full_rows * s.width :])
            if self.pads_itself and full_rows < block.shape[0]:
                block[full_rows, rest:].zero_()
                block[full_rows + 1 :].zero_()

    @property
    def pads_itself(self) -> bool:
        """Whether :meth:`scatter` zeroes the piece's padding (one segment covers all its columns)."""
        return len(self.segments) == 1

    @functools.cached_property
    def reads(self) -> tuple[tuple[str, int, int], ...]:
        """nvme tier: (swap key, element offset in the piece's pinned staging, elements) to read."""
        layout = self.layout
        if not layout.owns_state:
            return ()
        if self.tile is not None and layout.tile_align > 1:
            key, _, numel = layout.swap_layout()[self.tile]  # each tile is its own key: read just it
            return ((key, 0, numel),)
        return tuple(layout.swap_layout())  # the whole shard (a broadcast tile is sliced from it)

    @property
    def staging_numel(self) -> int:
        """Elements the piece's nc read lands in (its data starts at :attr:`staged_start`)."""
        return max((start + numel for _, start, numel in self.reads), default=0)

    @property
    def staged_start(self) -> int:
        """Where the piece's local data starts in its nc staging."""
        if self.tile is not None and self.layout.tile_align > 1:
            return 0
        return self.local_range[0]


@dataclasses.dataclass(frozen=True)
class UnitSizes:
    """Bytes a unit holds at each step; the store counts these and the schedule simulates them."""

    local: int  # the local input on the device (cg staging, all-gather input)
    gathered: int  # the gathered matrix (held from gather_start to release)
    pinned: int  # the nc read's pinned staging (0 off the nvme tier)
    reduce: int  # reduce-scatter input and output (held from reduce_grad_start to its wait)
    # A bucket's values copied out of the gathered matrix (each rank's slice of a
    # parameter is not contiguous in it): held next to the matrix while gather_wait runs.
    copy_out: int = 0


class Unit:
    """Pieces moved together by one collective (see the module docstring). Immutable."""

    def __init__(self, pieces: tuple[Piece, ...]):
        if not pieces:
            raise ZinfUnitError("a unit needs at least one piece")
        first = pieces[0].layout
        facts = lambda layout: (layout.partition, layout.compute_dtype, layout.world_size, layout.device,  # noqa: E731
                                layout.param_tier)
        for piece in pieces[1:]:
            if facts(piece.layout) != facts(first):
                raise ZinfUnitError(
                    f"{first.name} and {piece.layout.name} cannot share a bucket: (partition, compute dtype, world "
                    f"size, device, tier) {facts(first)} != {facts(piece.layout)}")
        if first.partition == "broadcast" and len(pieces) > 1:
            raise ZinfUnitError("partition='broadcast' moves one parameter per unit (each has its own owner)")
        self.pieces = pieces
        self.key = tuple((piece.layout.uid, piece.tile) for piece in pieces)
        self.name = ", ".join(piece.layout.name + (f"[tile {piece.tile}]" if piece.tile is not None else "")
                              for piece in pieces)
        self.partition = first.partition
        self.compute_dtype = first.compute_dtype
        self.device = first.device
        self.world_size = first.world_size
        self.rows = first.world_size if first.partition == "allgather" else 1
        # World size 1's bucket: nothing is gathered from other ranks, so each piece's value is a tensor of
        # its own, copied from its shard (one matrix would make the values alias each other, which the
        # graph's ops may not return, and the graph frees each value after its own last use).
        self.values_apart = self.rows == 1 and len(pieces) > 1
        offsets, column = [], 0
        for piece in pieces:
            offsets.append(column)
            column += piece.width
        self.offsets = tuple(offsets)
        self.columns = column
        # Where each piece's local data goes in the local input (allgather: at its columns; broadcast: all of it).
        self.local_numel = sum(piece.local_numel for piece in pieces)
        # Reductions at world size 1 add nothing up: each gradient goes into its
        # shard at once, in fp32, holding nothing (fp16 keeps its loss-scaling path).
        adds_at_once = (self.world_size == 1 and self.partition == "allgather"
                        and self.compute_dtype != torch.float16)
        self.staging_offsets = []
        pinned = 0
        itemsize = self.compute_dtype.itemsize
        for piece in pieces:
            self.staging_offsets.append(pinned)
            pinned += _align(piece.staging_numel * itemsize)
        reduce_matrix = 0 if adds_at_once else self.rows * self.columns * itemsize
        collective_out = self.columns * itemsize if self.rows > 1 else 0
        self.sizes = UnitSizes(
            local=self.local_numel * itemsize,
            gathered=self.rows * self.columns * itemsize,
            pinned=pinned if first.param_tier == "nvme" else 0,
            reduce=reduce_matrix + collective_out,
            copy_out=sum(piece.numel for piece in pieces) * itemsize if self.rows > 1 and len(pieces) > 1 else 0,
        )

    @property
    def tile(self) -> int | None:
        """The row tile the unit moves (None: whole parameters)."""
        return self.pieces[0].tile

    def column_block(self, matrix: torch.Tensor, index: int) -> torch.Tensor:
        """Piece ``index``'s columns of a ``rows x columns`` matrix (or of one flat row)."""
        start = self.offsets[index]
        return matrix.view(-1, self.columns)[:, start : start + self.pieces[index].width]

    def __repr__(self) -> str:
        return f"Unit({self.name})"


def unit_of(layouts, tile: int | None = None) -> Unit:
    """The unit of ``layouts`` (several: a bucket of whole parameters) or of one layout's ``tile``."""
    layouts = list(layouts)
    if tile is not None and len(layouts) != 1:
        raise ZinfUnitError(f"a tile unit holds one parameter, got {len(layouts)}")
    return Unit(tuple(Piece(layout, tile) for layout in layouts))


def can_share_unit(first: ParamLayout, other: ParamLayout) -> bool:
    """Whether two whole parameters may go in one bucket (one collective moves both)."""
    return (first.partition == other.partition == "allgather" and first.tile_rows is None
            and other.tile_rows is None and first.compute_dtype == other.compute_dtype
            and first.dtype == other.dtype  # (one dtype per gather_wait)
            and first.device == other.device and first.param_tier == other.param_tier
            and first.world_size == other.world_size)
