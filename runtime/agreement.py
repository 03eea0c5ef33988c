"""Ranks agree on what they run before any collective of it: the same graph, options and parameters.

zinf's collectives pair up across ranks by order alone.  A rank that runs
another compiled graph (a data-dependent branch or graph break that goes
differently per rank, MoE routing in Python) or was given other options
(stage, param_dtype, bucket_bytes, tile_factor: other collectives) would pair
its collectives with the wrong ones on the other ranks: a silently wrong
average, a gloo abort, or a hang naming nothing.  So at world size > 1, every
compile and every forward and backward call of a compiled graph first
exchanges a few integers (:func:`check`): what it is about to do, a
fingerprint of the graph and one of its options.  When they differ, all ranks
know it at once, exchange descriptions and raise the same
:class:`ZinfRankMismatchError` naming the cause, before any collective of the
graph runs.  The exchange is bounded by ``collective_timeout`` (gloo): a rank
that never arrives gives ``ZinfCollectiveTimeout``.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch

from .comm import Comm

# What a rank is about to do (the first integer exchanged).
COMPILE, FORWARD, BACKWARD = 1, 2, 3
_DOING = {COMPILE: "compiling", FORWARD: "the forward of", BACKWARD: "the backward of"}


class ZinfRankMismatchError(RuntimeError):
    """Ranks are about to run different graphs, or one graph with different options or parameters."""


def fingerprint(*parts: Any) -> int:
    """A signed 63-bit digest of ``parts``' text, equal on every rank for equal parts."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check(comm: Comm, doing: int, graph_print: int, options_print: int, describe: Callable[[], dict],
          timeout: float | None = None) -> None:
    """Raise on every rank unless every rank is ``doing`` the same graph with the same options.

    ``describe()`` (called only on a mismatch) gives this rank's side:
    ``graph`` (words naming the graph), ``options`` (name -> value) and
    ``params`` (name -> shape).  ``timeout``: the model's collective_timeout.
    """
    if comm.world_size == 1:
        return
    mine = torch.tensor([doing, graph_print, options_print], dtype=torch.int64, device=comm.agreement_device)
    rows = comm.all_gather_rows(mine, "all_gather of the ranks' graph fingerprints", timeout).tolist()
    if all(row == rows[0] for row in rows):
        return
    # Every rank saw the same rows, so every rank is here: the object exchange pairs up.
    sides = comm.all_gather_object({"doing": doing, **describe()}, "all_gather of the ranks' graph descriptions")
    raise ZinfRankMismatchError(_explain(sides, rows))


def _explain(sides: list[dict], rows: list[list[int]]) -> str:
    if any(row[:2] != rows[0][:2] for row in rows):
        running = "; ".join(f"rank {rank}: {_DOING[side['doing']]} {side['graph']}" for rank, side in enumerate(sides))
        return (f"zinf: ranks are about to run different graphs ({running}). zinf's collectives pair up across "
                f"ranks by order, so every rank must run the same compiled graphs in the same order: a "
                f"data-dependent branch or graph break that goes differently per rank (Python control flow on "
                f"tensor values, MoE routing that skips an expert on one rank) would average the wrong "
                f"gradients. Make the branch rank-independent (run every branch on every rank and mask or "
                f"weight its result, e.g. compute every expert and multiply unused ones by 0), or decide it "
                f"from values all ranks share")
    problems = []
    for name in sides[0]["options"]:
        values = [side["options"].get(name) for side in sides]
        if any(value != values[0] for value in values):
            problems.append(f"option {name!r}: " + ", ".join(f"rank {rank} has {value!r}"
                                                            for rank, value in enumerate(values)))
    names = sorted(set().union(*(side["params"] for side in sides)))
    for name in names:
        shapes = [side["params"].get(name) for side in sides]
        if any(shape != shapes[0] for shape in shapes):
            problems.append(f"parameter {name}: " + ", ".join(
                f"rank {rank} {'has none' if shape is None else 'has shape ' + str(tuple(shape))}"
                for rank, shape in enumerate(shapes)))
    detail = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    return (f"zinf: ranks compiled {sides[0]['graph']} differently: {detail or 'options differ'}. Every rank "
            f"must pass the same options to torch.compile and build the same model (these decide which "
            f"collectives run and their sizes)")
