"""How a checkpoint's files encode what they hold: the format's name, tensors as pieces of flat ranges, RNG states.

A piece is ``[first, stop, file offset]``: elements ``first:stop`` of the
*flat parameter* (not of a shard), so that a load in any layout finds, for
each range its shard needs, the pieces that cover it.
"""

from __future__ import annotations

import random

import torch

from ..runtime.checkpoint_files import ChecksummedWriter

FORMAT = "zinf-checkpoint/1"
COMMIT_MARKER = "COMMITTED"
CHUNK_NUMEL = 16 << 20  # elements per chunk streamed from an in-memory tensor


def tensor_chunks(flat: torch.Tensor):
    """A flat tensor as (first element, chunk on the CPU), CHUNK_NUMEL elements at a time."""
    for start in range(0, flat.numel(), CHUNK_NUMEL):
        yield start, flat[start : start + CHUNK_NUMEL].detach().to("cpu")


def write_ranges(writer: ChecksummedWriter, chunks, ranges) -> list[list[int]]:
    """Write the parts of a local tensor that ``ranges`` (first, stop, local_start) cover; their pieces.

    ``chunks`` streams the local tensor in order as (local start, tensor).
    A piece is ``[first, stop, file offset]`` of the flat parameter's
    elements; contiguous ones are merged.
    """
    pieces: list[list[int]] = []
    for chunk_start, chunk in chunks:
        chunk_stop = chunk_start + chunk.numel()
        for first, stop, local_start in ranges:
            low, high = max(chunk_start, local_start), min(chunk_stop, local_start + stop - first)
            if low >= high:
                continue
            offset = writer.write_tensor(chunk[low - chunk_start : high - chunk_start])
            logical = first + low - local_start
            itemsize = chunk.element_size()
            if pieces and pieces[-1][1] == logical and pieces[-1][2] + (pieces[-1][1] - pieces[-1][0]) * itemsize \
                    == offset:
                pieces[-1][1] = logical + high - low
            else:
                pieces.append([logical, logical + high - low, offset])
    return pieces


def rng_state() -> dict:
    """This rank's RNG states (torch, Python, CUDA where initialized) as JSON values, for a checkpoint."""
    state = {"torch": torch.get_rng_state().numpy().tobytes().hex(), "python": jsonable(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return state


def jsonable(value):
    """``value`` with its tuples as lists, nested (what JSON keeps)."""
    return [jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def tupled(value):
    """``value`` with its lists as tuples, nested (the inverse of :func:`jsonable`)."""
    return tuple(tupled(v) for v in value) if isinstance(value, list) else value


def set_rng_state(state: dict) -> None:
    """Restore the RNG states :func:`rng_state` gave (CUDA's on the devices this process has)."""
    torch.set_rng_state(torch.frombuffer(bytearray.fromhex(state["torch"]), dtype=torch.uint8))
    random.setstate(tupled(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        for device, hexed in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.frombuffer(bytearray.fromhex(hexed), dtype=torch.uint8), device)


def hyper(group: dict) -> dict:
    """A param group's hyperparameters that JSON can hold (tensors as floats)."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            value = value.item()
        out[key] = jsonable(value)
    return out

