"""The tile plan: which parameters are laid out in row tiles, and the rows of each tile.

:func:`tile_rows_for` is the one place that decides it for a parameter, from
its shape and bytes, the options, the world size, the device budget and the
other live bytes (pure: no graph, no store).  Two callers hand it what they
know: the ``tile`` pass's :func:`~zinf_compiler.passes.tile.plan_tiles` (at
compile time, for the weights the graph multiplies, with the graph's largest
other tensors) and ``zinf.materialize`` (before any graph exists, for every
weight over the threshold).  The plan is fixed when the parameter is
adopted: the store lays it out tile by tile.

Rule.  Stage 3 only, with the ``tile`` pass enabled; a 2-D parameter over
``tile_threshold`` bytes.  ``tile_factor`` gives the number of tiles (capped
by the rows); ``"auto"`` takes the smallest factor whose working set
(:func:`working_set_bytes`) fits the budget, or with no budget keeps each
tile within ``tile_threshold``.  Tiles are row ranges as equal as possible
(:func:`split_rows`); a factor of 1 is no plan (None).
"""

from __future__ import annotations

import math
from typing import Sequence

from .options import ZinfOptions
from .runtime.ledger import ZinfBudgetError
from .runtime.store import DTYPES

TILE_PASS = "tile"  # the pass's NAME: disable_passes=["tile"] turns tiling off, the plan included


def wants_tiles(shape: Sequence[int] | None, nbytes: int, options: ZinfOptions) -> bool:
    """Whether a parameter of ``shape`` holding ``nbytes`` is big enough to be tiled under ``options``."""
    return (options.stage == 3 and TILE_PASS not in options.disable_passes and shape is not None
            and len(shape) == 2 and nbytes > options.tile_threshold)


def tile_rows_for(name: str, shape: Sequence[int] | None, nbytes: int, options: ZinfOptions, world_size: int,
                  budget: int | None, other_bytes: int) -> tuple[int, ...] | None:
    """Rows per tile of parameter ``name`` (None: laid out whole).

    ``nbytes``: its bytes, compared with ``tile_threshold``; ``budget``: device bytes for gathered and
    in-flight tensors (None: unknown); ``other_bytes``: the largest other tensors live beside a tile.
    Raises :class:`ZinfBudgetError` when one-row tiles still do not fit ``budget``.
    """
    if not wants_tiles(shape, nbytes, options):
        return None
    rows, row_bytes = int(shape[0]), int(shape[1]) * DTYPES[options.param_dtype].itemsize
    factor = choose_factor(name, rows, row_bytes, options, max(world_size, 1), budget, other_bytes)
    return split_rows(rows, factor) if factor > 1 else None


def split_rows(rows: int, factor: int) -> tuple[int, ...]:
    """``rows`` in ``factor`` contiguous tiles as equal as possible (the first ones one row larger)."""
    factor = max(1, min(factor, rows))
    base, extra = divmod(rows, factor)
    return tuple(base + (1 if tile < extra else 0) for tile in range(factor))


def working_set_bytes(rows: int, row_bytes: int, factor: int, world_size: int, other_bytes: int) -> int:
    """What the runtime holds on the device while one tile of a ``factor``-tiled weight is in use.

    The gathered tile (padded to the world size), a second tile (the next one
    prefetched, or the tile's gradient being reduce-scattered) and the
    gradient's output slice, plus ``other_bytes`` of other live tensors.
    """
    tile_rows = split_rows(rows, factor)[0]
    tile_bytes = math.ceil(tile_rows * row_bytes / world_size) * world_size
    return 2 * tile_bytes + tile_bytes // world_size + other_bytes


def choose_factor(name: str, rows: int, row_bytes: int, options: ZinfOptions, world_size: int,
                  budget: int | None, other_bytes: int) -> int:
    """The tile factor of one oversized weight (1: leave it whole)."""
    if options.tile_factor != "auto":
        return max(1, min(int(options.tile_factor), rows))
    if budget is None:
        # Nothing to fit: keep each tile within the threshold that called the weight oversized.
        return max(1, min(rows, math.ceil(rows * row_bytes / max(options.tile_threshold, 1))))
    fits = lambda factor: working_set_bytes(rows, row_bytes, factor, world_size, other_bytes) <= budget  # noqa: E731
    if not fits(rows):
        need = working_set_bytes(rows, row_bytes, rows, world_size, other_bytes)
        raise ZinfBudgetError(
            f"tile pass: the matmul on {name} ({rows} rows of {row_bytes:,} bytes) does not fit "
            f"device_memory_limit={budget:,} even in {rows} one-row tiles: one tile's working set with the "
            f"largest other live tensors ({other_bytes:,} bytes) needs {need:,} bytes; raise device_memory_limit "
            f"or offload activations")
    low, high = 1, rows  # the working set shrinks as the factor grows: binary search the smallest that fits
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return low
