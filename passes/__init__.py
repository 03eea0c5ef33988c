"""The graph passes, one per file, in pipeline order.

Each pass module defines ``NAME`` (used by ``disable_passes`` and the dumps),
``KINDS`` (which ATen graphs it rewrites: "forward", "backward", "inference")
and ``run(gm, ctx) -> gm``.  A pass may only rewrite the graph it is given and
record facts in ``ctx.facts``; it never touches files, threads or the runtime.
"""

from . import activations, offload, partition, schedule, tile

PIPELINE: tuple = (tile, partition, activations, offload, schedule)


def pass_names() -> tuple[str, ...]:
    """The passes' names in pipeline order (what ``disable_passes`` accepts)."""
    return tuple(module.NAME for module in PIPELINE)
