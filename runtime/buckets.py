"""Bucketing: which consecutive parameters move in one collective.

One rule, used by the graphs' buckets (zinf_compiler/unit_plan.py: the gathers
and reduce-scatters the passes insert) and by the optimizer's own
collectives (store_grads.py: stage 1's reduction of ``param.grad``, the
publishing of updated shards).  Parameters are taken in the order given; a
bucket is a run of consecutive ones that may share one unit
(:func:`~zinf_compiler.runtime.units.can_share_unit`), have the same key (the
caller's further condition: the block in the graph, the mesh in the store)
and whose gathered bytes stay within the limit of the one joining it.  Pure:
layouts in, positions out.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from .units import ParamLayout, can_share_unit


def gathered_bytes(layout: ParamLayout) -> int:
    """Bytes a gather of the whole parameter produces (what a bucket's limit counts)."""
    return layout.gathered_numel * layout.compute_dtype.itemsize


def bucket_runs(layouts: Sequence[ParamLayout | None], limits: Sequence[int],
                keys: Sequence[Hashable | None]) -> list[list[int]]:
    """Positions of ``layouts`` grouped into buckets, in order.

    ``limits[i]``: the most gathered bytes a bucket may reach when layout ``i`` joins it (0: it joins
    none).  ``keys[i]``: layout ``i`` joins a bucket only if its key equals the bucket's first key;
    None moves alone (so does a None layout, a parameter not adopted) and starts a bucket no other joins.
    A parameter met twice in a row is not bucketed with itself.
    """
    runs: list[list[int]] = []
    held = 0
    for index, layout in enumerate(layouts):
        nbytes = gathered_bytes(layout) if layout is not None else 0
        run = runs[-1] if runs else None
        first = layouts[run[0]] if run else None
        joins = (run is not None and layout is not None and first is not None and keys[index] is not None
                 and keys[index] == keys[run[0]] and limits[index] > 0 and held + nbytes <= limits[index]
                 and all(layouts[other] is not layout for other in run) and can_share_unit(first, layout))
        if joins:
            run.append(index)
            held += nbytes
        else:
            runs.append([index])
            held = nbytes
    return runs
