"""Checkpoints: save every rank's shards, load them back at any world size, export consolidated weights.

    zinf.save("ckpt/step-1000", model, opt, extra={"data": loader_state})
    extra = zinf.load("ckpt/step-1000", model, opt)        # any world size, any offload setting
    zinf.export("gpt-final", model)                       # model.safetensors (+ config.json for transformers)

A checkpoint is a folder:

* ``rank-00000.bin``: raw bytes of what rank 0 holds (fp32 master slices,
  optimizer moments; full buffers and unsharded parameters on rank 0 only),
  streamed from the tier each rests on (a swap key or a 64 MiB chunk at a
  time: an NVMe-resident state never passes through memory whole).
* ``rank-00000.json``: where each piece lies: for every parameter and kind
  (``value``, ``state.exp_avg``, ...), the element ranges of the *flat
  parameter* it holds and their file offsets, a CRC32 per 4 MiB of the data
  file, scalar optimizer state (``step``) and the rank's RNG states.
* ``meta.json`` (rank 0): names, shapes and dtypes, the layout options each
  parameter was saved with, the optimizer's class and param groups, the fp16
  loss scale, and the CRC32 of every manifest.
* ``COMMITTED`` (rank 0, last): the CRC32 of ``meta.json``.

Element ranges of the flat parameter, not shards, are what make a checkpoint
independent of the layout: a load at another world size, partition, tile
plan or tier reads, for each range its shard needs, the pieces that cover it.

Atomicity: everything is written into ``<path>.partial``, each file under a
temporary name, fsynced and renamed; the ranks then agree (an all-gather of
outcomes) and rank 0 writes ``COMMITTED`` and renames the folder to
``<path>`` (a checkpoint already there is replaced).  A save killed at any
point leaves either the previous checkpoint or the new one, never a mix;
``load`` refuses a folder without ``COMMITTED``.  All ranks must see the same
filesystem at ``path`` (as with ``torch.distributed.checkpoint``'s
FileSystemWriter).

Why not ``torch.distributed.checkpoint`` (DCP) as the format: DCP's save and
load take a state dict whose values are tensors in memory (or DTensors whose
local shards are); a state resting in swap files would first have to be read
whole into RAM, which is what a model larger than RAM cannot do.  zinf's own
format streams instead; :func:`export` writes the consolidated safetensors
that the rest of the ecosystem (``transformers``, ``safetensors``, plain
``torch``) reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import time
import zlib
from typing import Any

import torch

from .api import _unwrap
from .optim import ZinfOptimizer
from .runtime.checkpoint_files import (DTYPE_NAMES, DTYPES_BY_NAME, ChecksummedWriter, RangeReader,
                                       SafetensorsWriter, ZinfCheckpointError, fsync_dir, read_checked,
                                       read_json_checked, verify_data_file, write_file_atomic, write_json_atomic)
from .runtime.nvme_adam import state_key, sub_groups
from .runtime.store import STORE, ParamRecord

log = logging.getLogger("zinf")

FORMAT = "zinf-checkpoint/1"
COMMIT_MARKER = "COMMITTED"
CHUNK_NUMEL = 16 << 20  # elements per chunk streamed from an in-memory tensor

__all__ = ["save", "load", "latest", "export", "to_safetensors", "ZinfCheckpointError"]


# --- what a model and its optimizer hold ---------------------------------------------


def _named_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return list(_unwrap(model).named_parameters())  # tied parameters once, under their first name


def _aliases(model: torch.nn.Module) -> dict[int, list[str]]:
    """id(tensor) -> every state-dict name it appears under (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, tensor in _unwrap(model).state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    return names


def _named_buffers(model: torch.nn.Module, param_ids: set[int]) -> list[tuple[str, torch.Tensor]]:
    """Persistent buffers (what ``state_dict`` holds besides parameters), once each."""
    seen, buffers = set(), []
    for name, tensor in _unwrap(model).state_dict(keep_vars=True).items():
        if id(tensor) not in param_ids and id(tensor) not in seen and isinstance(tensor, torch.Tensor):
            seen.add(id(tensor))
            buffers.append((name, tensor))
    return buffers


def _sharded(record: ParamRecord | None) -> bool:
    """Whether the parameter's truth is this rank's slice (stage 1-3), not a full tensor every rank holds."""
    return record is not None and record.stage > 0


def _chunks(flat: torch.Tensor):
    for start in range(0, flat.numel(), CHUNK_NUMEL):
        yield start, flat[start : start + CHUNK_NUMEL].detach().to("cpu")


def _write_ranges(writer: ChecksummedWriter, chunks, ranges) -> list[list[int]]:
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


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state().numpy().tobytes().hex(), "python": _jsonable(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return state


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray.fromhex(state["torch"]), dtype=torch.uint8))
    random.setstate(_tupled(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        for device, hexed in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.frombuffer(bytearray.fromhex(hexed), dtype=torch.uint8), device)


def _hyper(group: dict) -> dict:
    """A param group's hyperparameters that JSON can hold (tensors as floats)."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            value = value.item()
        out[key] = _jsonable(value)
    return out


# --- save ----------------------------------------------------------------------------


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None) -> str:
    """Write a checkpoint of ``model`` (and ``optimizer``) to the folder ``path``; every rank must call it.

    Each rank writes its own shards (fp32 masters, optimizer moments) from
    the tier they rest on; rank 0 adds buffers, parameters zinf does not
    shard, and ``extra`` (anything ``torch.save`` takes, e.g. a data loader
    or LR scheduler state; returned by :func:`load`).  RNG states are saved
    per rank.  The folder appears only once complete (see the module
    docstring); a checkpoint already at ``path`` is replaced.  Returns ``path``.
    """
    path = os.path.abspath(os.fspath(path))
    comm = STORE.comm
    rank, world_size = comm.rank, comm.world_size
    STORE.collect()
    started = time.perf_counter()
    if optimizer is not None:
        _check_optimizer(optimizer)
        optimizer._bind()
    staging = path + ".partial"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
        os.makedirs(staging)
    _barrier(comm, "creating " + staging)
    outcome, failure = None, None
    try:
        manifest = _write_rank(staging, rank, model, optimizer)
        manifest_name = f"rank-{rank:05d}.json"
        manifest_crc = write_json_atomic(os.path.join(staging, manifest_name), manifest)
        written = (manifest_name, manifest_crc, manifest["data"]["bytes"])
    except Exception as err:  # every rank must hear of it, or the others would commit without this rank
        written, outcome, failure = None, f"rank {rank}: {type(err).__name__}: {err}", err
    outcomes = comm.all_gather_object((written, outcome), "all_gather of checkpoint outcomes (save)")
    failed = [message for _, message in outcomes if message is not None]
    if failed:
        error = ZinfCheckpointError(f"save to {path} failed; nothing was committed (the previous checkpoint at that "
                                    f"path, if any, is untouched): " + "; ".join(failed))
        raise error from failure
    if rank == 0:
        meta = _meta(model, optimizer, world_size, {name: crc for (name, crc, _), _ in outcomes})
        if extra is not None:
            extra_path = os.path.join(staging, "extra.pt")
            torch.save(extra, extra_path + ".tmp")
            with open(extra_path + ".tmp", "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(extra_path + ".tmp", extra_path)
            meta["extra"] = {"file": "extra.pt", "crc32": _file_crc(extra_path)}
        meta_crc = write_json_atomic(os.path.join(staging, "meta.json"), meta)
        write_file_atomic(os.path.join(staging, COMMIT_MARKER), f"{meta_crc}\n".encode())
        fsync_dir(staging)
        _publish(staging, path)
    _barrier(comm, "committing " + path)
    total = sum(nbytes for (_, _, nbytes), _ in outcomes)
    log.info("zinf.save: %s (%s bytes over %d rank(s)) in %.1f s", path, f"{total:,}", world_size,
             time.perf_counter() - started)
    return path


def _barrier(comm, what: str) -> None:
    """A barrier that works on every backend (an all-gather of nothing)."""
    comm.all_gather_object(None, f"barrier ({what})")


def _file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def _publish(staging: str, path: str) -> None:
    """Rename the complete ``staging`` folder to ``path``, replacing a checkpoint there.

    If killed between the two renames, ``path`` is missing and ``<path>.old``
    holds the previous complete checkpoint; :func:`load` says so.
    """
    old = path + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staging, path)
    fsync_dir(os.path.dirname(path))
    shutil.rmtree(old, ignore_errors=True)


def _check_optimizer(optimizer) -> None:
    if not isinstance(optimizer, ZinfOptimizer):
        raise TypeError(f"zinf.save/load take a zinf optimizer (zinf_compiler.optim.AdamW, Adam or SGD), not "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")


def _write_rank(staging: str, rank: int, model, optimizer) -> dict:
    writer = ChecksummedWriter(os.path.join(staging, f"rank-{rank:05d}.bin"))
    entries, scalars = [], {}
    try:
        named = _named_params(model)
        for name, param in named:
            record = STORE.lookup(param)
            if _sharded(record):
                pieces = _write_ranges(writer, STORE.local_value_chunks(record), record.owned_ranges())
                dtype = record.holding_dtype
            elif rank == 0:
                full = param.detach().reshape(-1)
                pieces = _write_ranges(writer, _chunks(full), [(0, full.numel(), 0)])
                dtype = full.dtype
            else:
                continue
            entries.append({"name": name, "kind": "value", "dtype": DTYPE_NAMES[dtype], "pieces": pieces})
        if rank == 0:
            for name, buffer in _named_buffers(model, {id(p) for _, p in named}):
                full = buffer.detach().reshape(-1)
                entries.append({"name": name, "kind": "buffer", "dtype": DTYPE_NAMES[full.dtype],
                                "pieces": _write_ranges(writer, _chunks(full), [(0, full.numel(), 0)])})
        if optimizer is not None:
            names = {id(p): name for name, p in named}
            for slot in optimizer._all_slots():
                name = names.get(id(slot.param))
                if name is None:
                    raise ZinfCheckpointError("the optimizer holds a parameter that is not one of the model's; save "
                                              "a model together with the optimizer over its own parameters")
                for kind, dtype, chunks, ranges, scalar in _optimizer_state(optimizer, slot, rank):
                    if scalar is not None:
                        scalars.setdefault(name, {})[kind] = scalar
                    else:
                        entries.append({"name": name, "kind": "state." + kind, "dtype": DTYPE_NAMES[dtype],
                                        "pieces": _write_ranges(writer, chunks, ranges)})
        data = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"format": FORMAT, "rank": rank, "data": data, "entries": entries, "scalars": scalars,
            "rng": _rng_state()}


def _optimizer_state(optimizer: ZinfOptimizer, slot, rank: int):
    """(kind, dtype, chunks, ranges, scalar) of a slot's optimizer state on this rank.

    Sharded slots give their local tensors with the record's owned ranges;
    unsharded ones (stage 0, or a parameter zinf does not shard) the full
    tensors, from rank 0.  Scalars (``step``) come as ``[value, dtype]``.
    """
    record = slot.record
    if record is not None and record.stage > 0 and record.opt_tier == "nvme":
        steps = optimizer._nvme.steps.get(record.uid, 0) if optimizer._nvme is not None else 0
        if not steps or not record.owns_state:
            return
        yield "step", None, None, None, [float(steps), "float32"]
        for kind in ("exp_avg", "exp_avg_sq"):
            chunks = ((start, STORE._read_swap(record.swap, state_key(kind, record.uid, index), torch.float32,
                                               stop - start, torch.device("cpu")))
                      for index, (start, stop) in enumerate(sub_groups(record.local_numel)))
            yield kind, torch.float32, chunks, record.owned_ranges(), None
        return
    if optimizer._inner is None:
        return
    state = optimizer._inner.state.get(slot.master, {})
    sharded = _sharded(record)
    if not sharded and rank != 0:
        return
    for kind, value in state.items():
        if not isinstance(value, torch.Tensor):
            yield kind, None, None, None, [value, "python"]
        elif value.dim() == 0:
            yield kind, None, None, None, [value.item(), DTYPE_NAMES[value.dtype]]
        elif sharded:
            yield kind, value.dtype, _chunks(value.reshape(-1)), record.owned_ranges(), None
        else:
            yield kind, value.dtype, _chunks(value.reshape(-1)), [(0, value.numel(), 0)], None


def _meta(model, optimizer, world_size: int, manifests: dict[str, int]) -> dict:
    named = _named_params(model)
    aliases = _aliases(model)
    params = {}
    for name, param in named:
        record = STORE.lookup(param)
        layout = None
        if record is not None:
            layout = {"stage": record.stage, "partition": record.partition,
                      "param_dtype": DTYPE_NAMES[record.compute_dtype], "param_tier": record.param_tier,
                      "opt_tier": record.opt_tier, "tile_rows": list(record.tile_rows) if record.tile_rows else None}
        shape = list(record.shape) if record is not None else list(param.shape)
        dtype = record.dtype if record is not None else param.dtype
        params[name] = {"shape": shape, "dtype": DTYPE_NAMES[dtype], "aliases": aliases.get(id(param), [name]),
                        "requires_grad": param.requires_grad, "layout": layout}
    buffers = {name: {"shape": list(b.shape), "dtype": DTYPE_NAMES[b.dtype]}
               for name, b in _named_buffers(model, {id(p) for _, p in named})}
    meta = {"format": FORMAT, "world_size": world_size, "params": params, "buffers": buffers,
            "manifests": manifests, "saved_at": time.time(),
            "fp16_scaler": {"scale": STORE.fp16_scaler.scale, "good_steps": STORE.fp16_scaler.good_steps,
                            "skipped_steps": STORE.fp16_scaler.skipped_steps},
            "optimizer": None}
    if optimizer is not None:
        names = {id(p): name for name, p in named}
        meta["optimizer"] = {
            "class": type(optimizer).__name__,
            "param_groups": [{**_hyper(group), "params": [names[id(p)] for p in group["params"]]}
                             for group in optimizer.param_groups],
        }
    return meta


# --- load ----------------------------------------------------------------------------


class Checkpoint:
    """A committed checkpoint folder, verified, indexed by (name, kind) -> pieces."""

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        marker = os.path.join(path, COMMIT_MARKER)
        if not os.path.exists(marker):
            raise ZinfCheckpointError(_not_committed(path))
        try:
            meta_crc = int(read_checked(marker, None, "commit marker").decode().strip())
        except ValueError:
            raise ZinfCheckpointError(f"commit marker {marker} is damaged: the checkpoint is corrupt") from None
        self.meta = read_json_checked(os.path.join(path, "meta.json"), meta_crc, "checkpoint metadata")
        if self.meta.get("format") != FORMAT:
            raise ZinfCheckpointError(f"{path} holds a checkpoint of format {self.meta.get('format')!r}; this zinf "
                                      f"reads {FORMAT!r}")
        self.manifests = [read_json_checked(os.path.join(path, name), crc, "checkpoint manifest")
                          for name, crc in sorted(self.meta["manifests"].items())]
        self.pieces: dict[tuple[str, str], list] = {}
        self.scalars: dict[str, dict] = {}
        for manifest in self.manifests:
            data_path = os.path.join(path, manifest["data"]["file"])
            for entry in manifest["entries"]:
                dtype = DTYPES_BY_NAME[entry["dtype"]]
                self.pieces.setdefault((entry["name"], entry["kind"]), []).extend(
                    (first, stop, data_path, offset, dtype) for first, stop, offset in entry["pieces"])
            for name, values in manifest["scalars"].items():
                self.scalars.setdefault(name, values)
        for pieces in self.pieces.values():
            pieces.sort()
        self.reader = RangeReader()

    def verify(self, comm) -> None:
        """Check every data file's blocks, the work split over ranks; all ranks raise the same error."""
        errors = []
        for index, manifest in enumerate(self.manifests):
            if index % comm.world_size != comm.rank:
                continue
            try:
                verify_data_file(os.path.join(self.path, manifest["data"]["file"]), manifest["data"])
            except ZinfCheckpointError as err:
                errors.append(str(err))
        gathered = comm.all_gather_object(errors, "all_gather of checkpoint verification (load)")
        found = [message for messages in gathered for message in messages]
        if found:
            raise ZinfCheckpointError(f"load from {self.path} refused, nothing was changed: " + "; ".join(found))

    def has(self, name: str, kind: str) -> bool:
        return (name, kind) in self.pieces

    def read_ranges(self, name: str, kind: str, ranges, local_numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A local tensor of ``local_numel`` elements: each (first, stop, local_start) range filled from the pieces."""
        out = torch.zeros(local_numel, dtype=dtype)
        pieces = self.pieces.get((name, kind), [])
        for first, stop, local_start in ranges:
            covered = 0
            for piece_first, piece_stop, data_path, offset, piece_dtype in pieces:
                low, high = max(first, piece_first), min(stop, piece_stop)
                if low >= high:
                    continue
                values = self.reader.read_tensor(data_path, offset + (low - piece_first) * piece_dtype.itemsize,
                                                 piece_dtype, high - low)
                out[local_start + low - first : local_start + high - first].copy_(values)
                covered += high - low
            if covered != stop - first:
                raise ZinfCheckpointError(f"{self.path}: the checkpoint holds {covered:,} of elements {first:,}-"
                                          f"{stop:,} of {name} ({kind}); it is incomplete or was written by "
                                          f"another model")
        return out

    def read_full(self, name: str, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.read_ranges(name, kind, [(0, numel, 0)], numel, dtype)

    def read_local(self, record: ParamRecord, name: str, kind: str, dtype: torch.dtype) -> torch.Tensor:
        return self.read_ranges(name, kind, record.owned_ranges(), record.local_numel, dtype)

    def close(self) -> None:
        self.reader.close()


def _not_committed(path: str) -> str:
    if os.path.isdir(path + ".old") and os.path.exists(os.path.join(path + ".old", COMMIT_MARKER)):
        return (f"no checkpoint at {path}: a save that was replacing it was interrupted; the previous complete "
                f"checkpoint is at {path}.old (load that, or rename it)")
    if os.path.isdir(path + ".partial"):
        return (f"no complete checkpoint at {path}: the save was interrupted ({path}.partial has no commit "
                f"marker); load an earlier checkpoint (zinf.latest(folder) finds the newest complete one)")
    if os.path.isdir(path):
        return (f"{path} is not a complete zinf checkpoint: it has no {COMMIT_MARKER} marker (a save interrupted "
                f"before its commit, or not a zinf checkpoint)")
    return f"no checkpoint at {path}"


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         weights_only: bool = True) -> Any:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``); returns its ``extra``.

    Every rank must call it.  Works at any world size, partition, tile plan
    and offload tier: each rank reads the element ranges its shards hold.
    The whole checkpoint is verified first (each rank checks a share of the
    data files' checksums) and a partial, corrupt or mismatched one is
    refused with an error naming the file, before anything is changed.

    The model's parameters get the saved fp32 values, its buffers theirs;
    gradients are dropped (as after ``opt.zero_grad()``).  The optimizer gets
    its param groups' hyperparameters at once and its state (moments, step
    counts) when it binds to the shards: now if the model has run, else at
    its first step.  RNG states are restored when the world size is the one
    saved (each rank its own).  ``weights_only`` is passed to ``torch.load``
    for ``extra``.
    """
    path = os.path.abspath(os.fspath(path))
    comm = STORE.comm
    STORE.collect()
    try:
        checkpoint = Checkpoint(path)
        error = None
    except ZinfCheckpointError as err:
        checkpoint, error = None, str(err)
    errors = comm.all_gather_object(error, "all_gather of checkpoint metadata checks (load)")
    if any(errors):
        raise ZinfCheckpointError(next(message for message in errors if message))
    checkpoint.verify(comm)
    _check_matches(checkpoint, model, optimizer)
    meta = checkpoint.meta
    extra = None
    if "extra" in meta:
        extra_path = os.path.join(path, meta["extra"]["file"])
        if _file_crc(extra_path) != meta["extra"]["crc32"]:
            raise ZinfCheckpointError(f"{extra_path} is corrupt: its CRC32 differs from the one in meta.json")
        extra = torch.load(extra_path, weights_only=weights_only)
    _load_model(checkpoint, model)
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, meta["optimizer"]["param_groups"]):
            for key, value in saved.items():
                if key != "params":
                    group[key] = _tupled(value) if isinstance(value, list) else value
        optimizer.zero_grad()
        optimizer._attach_checkpoint(checkpoint, {id(p): name for name, p in _named_params(model)})
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if optimizer._inner is not None or all(STORE.lookup(p) is not None for p in params):
            optimizer._bind()  # the binding is final: apply the state now
    else:
        checkpoint.close()
    scaler = meta["fp16_scaler"]
    STORE.fp16_scaler.scale = scaler["scale"]
    STORE.fp16_scaler.good_steps = scaler["good_steps"]
    STORE.fp16_scaler.skipped_steps = scaler["skipped_steps"]
    if meta["world_size"] == comm.world_size:
        _set_rng_state(checkpoint.manifests[comm.rank]["rng"])
    else:
        log.info("zinf.load: saved at world size %d, loaded at %d: RNG states not restored", meta["world_size"],
                 comm.world_size)
    return extra


def _check_matches(checkpoint: Checkpoint, model, optimizer) -> None:
    meta = checkpoint.meta
    named = _named_params(model)
    saved = meta["params"]
    problems = []
    mine = {name for name, _ in named}
    missing = sorted(mine - set(saved))
    unexpected = sorted(set(saved) - mine)
    if missing:
        problems.append(f"parameters not in the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"parameters of the checkpoint not in the model: {unexpected[:8]}"
                        f"{' ...' if len(unexpected) > 8 else ''}")
    shapes = []
    for name, param in named:
        record = STORE.lookup(param)
        shape = list(record.shape if record is not None else param.shape)
        if name in saved and saved[name]["shape"] != shape:
            shapes.append(f"{name} has shape {tuple(shape)}, the checkpoint {tuple(saved[name]['shape'])}")
    problems += shapes[:4] + ([f"{len(shapes) - 4} more shapes differ"] if len(shapes) > 4 else [])
    buffers = {name for name, _ in _named_buffers(model, {id(p) for _, p in named})}
    if buffers != set(meta["buffers"]):
        problems.append(f"buffers differ: model only {sorted(buffers - set(meta['buffers']))}, checkpoint only "
                        f"{sorted(set(meta['buffers']) - buffers)}")
    if optimizer is not None:
        _check_optimizer(optimizer)
        saved_opt = meta["optimizer"]
        if saved_opt is None:
            problems.append("the checkpoint has no optimizer state (saved without an optimizer)")
        elif saved_opt["class"] != type(optimizer).__name__:
            problems.append(f"the checkpoint's optimizer is {saved_opt['class']}, this one is "
                            f"{type(optimizer).__name__}")
        else:
            names = {id(p): name for name, p in named}
            groups = [[names.get(id(p), "?") for p in group["params"]] for group in optimizer.param_groups]
            if groups != [group["params"] for group in saved_opt["param_groups"]]:
                problems.append("the optimizer's param groups hold other parameters than the checkpoint's")
    if problems:
        raise ZinfCheckpointError(f"checkpoint {checkpoint.path} does not match the model: " + "; ".join(problems)
                                  + ". Nothing was changed.")


@torch.no_grad()
def _load_model(checkpoint: Checkpoint, model) -> None:
    named = _named_params(model)
    records = []
    for name, param in named:
        record = STORE.lookup(param)
        if _sharded(record):
            records.append(record)
            if record.stage == 3:
                STORE.assign_local(record, checkpoint.read_local(record, name, "value", record.holding_dtype))
                continue
            # Stages 1-2: the full parameter is in memory anyway; the master takes the saved fp32 values.
            full = checkpoint.read_full(name, "value", record.numel, record.holding_dtype)
            param.data.copy_(full.view(record.shape))
            STORE.assign_full(record, full.view(record.shape))
            record.synced_version = param._version
        else:
            full = checkpoint.read_full(name, "value", param.numel(), param.dtype)
            param.copy_(full.view(param.shape))
        param.grad = None
    STORE.drop_grads(records)
    for name, buffer in _named_buffers(model, {id(p) for _, p in named}):
        buffer.copy_(checkpoint.read_full(name, "buffer", buffer.numel(), buffer.dtype).view(buffer.shape))


def apply_optimizer_state(optimizer: ZinfOptimizer, checkpoint: Checkpoint, names: dict[int, str]) -> None:
    """Give a bound optimizer the checkpoint's state for its slots, in this run's layout.

    Called by the optimizer when it binds (see ZinfOptimizer._attach_checkpoint).
    Masters of sharded parameters are written again from the saved fp32
    values (a parameter adopted after :func:`load` took them from the full
    tensor, which may be lower precision).
    """
    with torch.no_grad():
        for slot in optimizer._all_slots():
            if _sharded(slot.record):
                name = names[id(slot.param)]
                STORE.assign_local(slot.record, checkpoint.read_local(slot.record, name, "value",
                                                                      slot.record.holding_dtype))
    if optimizer._inner is not None:
        inner_state = optimizer._inner.state_dict()
        new_state, index = {}, 0
        for group_slots in optimizer._slots:
            for slot in group_slots:
                state = _slot_state(checkpoint, slot, names[id(slot.param)])
                if state:
                    new_state[index] = state
                index += 1
        inner_state["state"] = new_state
        optimizer._inner.load_state_dict(inner_state)
    for slot, _ in optimizer._nvme_slots:
        record = slot.record
        name = names[id(slot.param)]
        step = checkpoint.scalars.get(name, {}).get("step")
        steps = int(step[0]) if step is not None else 0
        if steps and record.owns_state:
            for kind in ("exp_avg", "exp_avg_sq"):
                local = checkpoint.read_local(record, name, "state." + kind, torch.float32)
                for index, (start, stop) in enumerate(sub_groups(record.local_numel)):
                    STORE._write_swap(record.swap, state_key(kind, record.uid, index), local[start:stop])
                del local
            optimizer._nvme.steps[record.uid] = steps
        else:
            optimizer._nvme.steps.pop(record.uid, None)
    optimizer._account_state()


def _slot_state(checkpoint: Checkpoint, slot, name: str) -> dict:
    """The inner optimizer's state for one in-memory slot, in this run's layout (empty: none saved)."""
    record = slot.record
    state = {}
    for kind, (value, dtype_name) in checkpoint.scalars.get(name, {}).items():
        state[kind] = value if dtype_name == "python" else torch.tensor(value, dtype=DTYPES_BY_NAME[dtype_name])
    kinds = [kind for (saved_name, kind) in checkpoint.pieces if saved_name == name and kind.startswith("state.")]
    for kind in kinds:
        dtype = checkpoint.pieces[(name, kind)][0][4]
        if _sharded(record):
            if not record.owns_state:
                return {}
            value = checkpoint.read_local(record, name, kind, dtype)
        else:
            value = checkpoint.read_full(name, kind, slot.param.numel(), dtype).view(slot.param.shape)
        state[kind[len("state."):]] = value
    if kinds and "step" not in state:
        raise ZinfCheckpointError(f"{checkpoint.path}: optimizer state of {name} has moments but no step count")
    return state if kinds or state else {}


def latest(root: str | os.PathLike) -> str | None:
    """The most recently committed checkpoint folder directly under ``root`` (None: there is none).

    Folders a killed save left (no commit marker) are skipped.
    """
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    best = None
    for name in os.listdir(root):
        marker = os.path.join(root, name, COMMIT_MARKER)
        if name.endswith((".partial", ".old")) or not os.path.exists(marker):
            continue
        try:
            with open(os.path.join(root, name, "meta.json")) as handle:
                saved_at = json.load(handle)["saved_at"]
        except (OSError, ValueError, KeyError):
            continue
        if best is None or saved_at > best[0]:
            best = (saved_at, os.path.join(root, name))
    return best[1] if best else None


def to_safetensors(path: str | os.PathLike, out: str | os.PathLike) -> str:
    """Convert a checkpoint folder to one consolidated ``model.safetensors`` under ``out``; no model, no ranks.

    The converter to the ecosystem's formats: the fp32 values of every
    parameter (tied ones once) and every buffer, read and written one tensor
    at a time.  ``transformers`` and ``safetensors`` load the file, and so does
    ``torch.distributed.checkpoint`` through its ``HuggingFaceStorageReader``.
    Optimizer state stays in zinf's format.
    """
    checkpoint = Checkpoint(os.path.abspath(os.fspath(path)))
    try:
        for manifest in checkpoint.manifests:
            verify_data_file(os.path.join(checkpoint.path, manifest["data"]["file"]), manifest["data"])
        meta = checkpoint.meta
        tensors = [(name, "value", info) for name, info in meta["params"].items()]
        tensors += [(name, "buffer", info) for name, info in meta["buffers"].items()]
        dtypes = {name: checkpoint.pieces[(name, kind)][0][4] if checkpoint.has(name, kind)
                  else DTYPES_BY_NAME[info["dtype"]] for name, kind, info in tensors}
        out = os.path.abspath(os.fspath(out))
        os.makedirs(out, exist_ok=True)
        writer = SafetensorsWriter(os.path.join(out, "model.safetensors"),
                                   [(name, dtypes[name], tuple(info["shape"])) for name, _, info in tensors])
        try:
            for name, kind, info in tensors:
                numel = int(torch.Size(info["shape"]).numel())
                writer.write(name, checkpoint.read_full(name, kind, numel, dtypes[name]))
            writer.close()
        except BaseException:
            writer.abort()
            raise
    finally:
        checkpoint.close()
    return out


# --- export --------------------------------------------------------------------------


@torch.no_grad()
def export(path: str | os.PathLike, model: torch.nn.Module, format: str = "safetensors",
           dtype: torch.dtype | None = None) -> str:
    """Write the model's consolidated weights to the folder ``path`` as ``model.safetensors``; every rank calls it.

    Loadable by ``safetensors.torch.load_file`` and ``model.load_state_dict``,
    and, for a ``transformers`` model (one with ``config.save_pretrained``),
    by ``from_pretrained(path)``: its ``config.json`` is written too.  Tied
    weights are written once, under their first name (as ``save_pretrained``
    does).  Parameters are gathered one at a time and written by rank 0 as
    they arrive, so memory holds at most one full parameter.  Values are the
    parameters as the model computes with them (``param_dtype``), in the
    model's dtype or ``dtype``; the fp32 masters are in :func:`save`'s
    checkpoints.
    """
    if format != "safetensors":
        raise ValueError(f"zinf.export writes format='safetensors' only, not {format!r}")
    path = os.path.abspath(os.fspath(path))
    comm = STORE.comm
    rank = comm.rank
    STORE.collect()
    module = _unwrap(model)
    named = _named_params(module)
    tensors = [(name, param) for name, param in named] + _named_buffers(module, {id(p) for _, p in named})
    entries = []
    for name, tensor in tensors:
        record = STORE.lookup(tensor)
        shape = tuple(record.shape if record is not None else tensor.shape)
        out_dtype = dtype if dtype is not None and tensor.is_floating_point() else (
            record.dtype if record is not None else tensor.dtype)
        entries.append((name, out_dtype, shape))
    writer = None
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        writer = SafetensorsWriter(os.path.join(path, "model.safetensors"), entries, {"format": "pt"})
    try:
        for (name, tensor), (_, out_dtype, _) in zip(tensors, entries):
            record = STORE.lookup(tensor)
            if record is not None and record.stage == 3:
                with _gathered(record) as full:  # a collective: every rank, in the same order
                    if writer is not None:
                        writer.write(name, full.to(out_dtype))
            elif writer is not None:
                writer.write(name, tensor.detach().to(out_dtype))
        if writer is not None:
            writer.close()
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(path)
            fsync_dir(path)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    _barrier(comm, "export to " + path)
    return path


@contextlib.contextmanager
def _gathered(record: ParamRecord):
    """The full parameter for the block (collective), released after it; never a second full copy."""
    unit = STORE.unit([record])
    STORE.gather_start(unit)
    try:
        yield STORE.gather_wait(unit)[0]
    finally:
        STORE.release(unit)
