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
A model sharded over a ``mesh`` option's 2-D mesh (HSDP) is saved by its
first replica alone, one file per shard rank (the other replicas hold the
same shards); ``meta.json`` says so (``mesh``).  It loads like any other
checkpoint, into any mesh or none.

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
import io
import json
import logging
import math
import os
import pickle
import random
import shutil
import tempfile
import time
import zlib
from typing import Any

import torch

from .api import _unwrap
from .optim import ZinfOptimizer
from .runtime.checkpoint_files import (DTYPE_NAMES, DTYPES_BY_NAME, ChecksummedWriter, RangeReader,
                                       SafetensorsWriter, ZinfCheckpointError, check_data_description,
                                       check_file_name, create_new, fsync_dir, read_checked,
                                       read_json_checked, replace_into_place, verify_data_file, write_file_atomic,
                                       write_json_atomic)
from .runtime.nvme_adam import state_key, sub_groups
from .runtime.store import ParamRecord
from .api import RUNTIME

log = logging.getLogger("zinf")

FORMAT = "zinf-checkpoint/1"
COMMIT_MARKER = "COMMITTED"
CHUNK_NUMEL = 16 << 20  # elements per chunk streamed from an in-memory tensor

__all__ = ["save", "load", "latest", "export", "to_safetensors", "ZinfCheckpointError"]


# --- what a model and its optimizer hold ---------------------------------------------


def _spanning_meshes(model: torch.nn.Module, what: str) -> dict:
    """The meshes the model's sharded parameters use: ``{None or id(mesh): (a parameter's name, mesh or None)}``
    (None: the default group's ranks).  A mesh over only some of the ranks is refused naming the parameter:
    all ranks call save, load and export."""
    meshes = {}
    for _, param in _named_params(model):
        record = RUNTIME.store.lookup(param)
        if record is None:
            continue
        if record.mesh.is_default:
            meshes.setdefault(None, (record.name, None))
            continue
        if record.mesh.everyone.world_size != RUNTIME.store.comm.world_size:
            raise ZinfCheckpointError(
                f"zinf.{what}: parameter {record.name} is sharded over {record.mesh.describe()} (option mesh), which "
                f"spans {record.mesh.everyone.world_size} of the {RUNTIME.store.comm.world_size} ranks; checkpoints "
                f"need a mesh over every rank. zinf.full_state_dict(model) gathers every weight on every rank of the "
                f"mesh (save it from one rank with torch.save; load it with model.load_state_dict)")
        meshes.setdefault(id(record.mesh), (record.name, record.mesh))
    return meshes


def _model_mesh(model: torch.nn.Module, what: str):
    """The one mesh the model's parameters are sharded over (None: the default group's ranks).

    Checkpoint files are numbered by the ranks of that one mesh: parameters
    sharded over different ones (or some over a mesh, some over every rank)
    are refused naming two of them.
    """
    meshes = _spanning_meshes(model, what)
    if len(meshes) > 1:
        (first, mesh), (second, other) = list(meshes.values())[:2]
        describe = lambda m: m.describe() if m is not None else "every rank"  # noqa: E731
        raise ZinfCheckpointError(f"zinf.{what}: parameters {first} and {second} are sharded over different meshes "
                                  f"({describe(mesh)}, {describe(other)}); save each model on its own")
    return next(iter(meshes.values()))[1] if meshes else None


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
    comm = RUNTIME.store.comm
    rank = comm.rank
    RUNTIME.store.collect()
    # The files are numbered by shard rank.  With replicas (HSDP) every replica holds the same
    # shards: the first writes them, the others only take part in the agreement.
    mesh = _model_mesh(model, "save")
    if mesh is None:
        file_rank, world_size, writes = comm.rank, comm.world_size, True
    else:
        file_rank, world_size = mesh.shard.rank, mesh.shard.world_size
        writes = mesh.replicate is None or mesh.replicate.rank == 0
    started = time.perf_counter()
    if optimizer is not None:
        _check_optimizer(optimizer)
        optimizer.bind()
    staging = path + ".partial"
    prepared = None
    if rank == 0:
        try:
            _remove(staging)  # what a killed save left (a link there is removed, never followed)
            os.makedirs(staging)
        except OSError as err:
            prepared = f"cannot create {staging} ({err})"
    prepared = comm.all_gather_object(prepared, "all_gather of checkpoint staging (save)")[0]
    if prepared is not None:
        raise ZinfCheckpointError(f"save to {path} failed; nothing was written: {prepared}")
    outcome, failure = None, None
    written = None  # (manifest, its CRC32, data bytes) of a rank that writes
    try:
        if writes:
            manifest = _write_rank(staging, file_rank, model, optimizer)
            manifest_name = f"rank-{file_rank:05d}.json"
            manifest_crc = write_json_atomic(os.path.join(staging, manifest_name), manifest)
            written = (manifest_name, manifest_crc, manifest["data"]["bytes"])
    except Exception as err:  # every rank must hear of it, or the others would commit without this rank
        written, outcome, failure = None, f"rank {rank}: {type(err).__name__}: {err}", err
    outcomes = comm.all_gather_object((written, outcome), "all_gather of checkpoint outcomes (save)")
    failed = [message for _, message in outcomes if message is not None]
    if failed:
        if rank == 0:
            _remove(staging, quiet=True)  # every rank is done with it
        error = ZinfCheckpointError(f"save to {path} failed; nothing was committed (the previous checkpoint at that "
                                    f"path, if any, is untouched): " + "; ".join(failed))
        raise error from failure
    committed = None
    if rank == 0:
        try:
            _commit(staging, path, model, optimizer, extra, world_size,
                    {written[0]: written[1] for written, _ in outcomes if written is not None}, mesh)
        except Exception as err:  # the other ranks wait for the outcome, not for a barrier that never comes
            _remove(staging, quiet=True)
            committed, failure = f"{type(err).__name__}: {err}", err
    committed = comm.all_gather_object(committed, "all_gather of the checkpoint commit (save)")[0]
    if committed is not None:
        error = ZinfCheckpointError(f"save to {path} failed while committing; nothing was committed (the previous "
                                    f"checkpoint at that path, if any, is untouched): {committed}")
        raise error from failure
    total = sum(written[2] for written, _ in outcomes if written is not None)
    log.info("zinf.save: %s (%s bytes over %d rank(s)) in %.1f s", path, f"{total:,}", world_size,
             time.perf_counter() - started)
    return path


def _commit(staging: str, path: str, model, optimizer, extra, world_size: int, manifests: dict[str, int],
            mesh) -> None:
    """Rank 0: write ``extra``, ``meta.json`` and the commit marker into ``staging``, then publish it at ``path``."""
    meta = _meta(model, optimizer, world_size, manifests)
    if mesh is not None:
        # Said for the reader: the files are the shard group's; RNG states are the writing replica's only.
        meta["mesh"] = {"replicas": mesh.replicate.world_size if mesh.replicate is not None else 1,
                        "shards": mesh.shard.world_size}
    if extra is not None:
        extra_path = os.path.join(staging, "extra.pt")
        with create_new(extra_path + ".tmp") as handle:
            torch.save(extra, handle)
            handle.flush()
            os.fsync(handle.fileno())
        replace_into_place(extra_path + ".tmp", extra_path)
        meta["extra"] = {"file": "extra.pt", "crc32": _file_crc(extra_path)}
    meta_crc = write_json_atomic(os.path.join(staging, "meta.json"), meta)
    write_file_atomic(os.path.join(staging, COMMIT_MARKER), f"{meta_crc}\n".encode())
    fsync_dir(staging)
    _publish(staging, path)


def _barrier(comm, what: str) -> None:
    """A barrier that works on every backend (an all-gather of nothing)."""
    comm.all_gather_object(None, f"barrier ({what})")


def _file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def _remove(path: str, quiet: bool = False) -> None:
    """Remove what is at ``path``: a folder with its content, or a file or link (a link's target is kept)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # rmtree never follows a link inside the folder
        elif os.path.lexists(path):
            os.unlink(path)
    except OSError:
        if not quiet:
            raise


def _publish(staging: str, path: str) -> None:
    """Rename the complete ``staging`` folder to ``path``, replacing a checkpoint there.

    If killed between the two renames, ``path`` is missing and ``<path>.old``
    holds the previous complete checkpoint; :func:`load` says so.  What is at
    ``<path>.old`` beforehand (a folder a killed publish left, or a planted
    link) is removed, never followed.  If a rename fails, the previous
    checkpoint is put back at ``path``, ``staging`` is removed, and the error
    says why.
    """
    old = path + ".old"
    _remove(old)
    moved_aside = False
    try:
        if os.path.lexists(path):
            os.rename(path, old)
            moved_aside = True
        os.rename(staging, path)
    except OSError as err:
        if moved_aside:
            with contextlib.suppress(OSError):
                os.rename(old, path)
        raise ZinfCheckpointError(f"cannot publish the checkpoint {staging} as {path} ({err}); the previous "
                                  f"checkpoint there, if any, is kept") from None
    fsync_dir(os.path.dirname(path))
    _remove(old, quiet=True)


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
            record = RUNTIME.store.lookup(param)
            if _sharded(record):
                pieces = _write_ranges(writer, RUNTIME.store.local_value_chunks(record), record.owned_ranges())
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
            for slot in optimizer.slots():
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
    if slot.state_on_nvme:
        steps = optimizer.nvme_steps(slot)
        if not steps or not record.owns_state:
            return
        yield "step", None, None, None, [float(steps), "float32"]
        for kind in ("exp_avg", "exp_avg_sq"):
            chunks = ((start, RUNTIME.store.read_swap(record.swap, state_key(kind, record.uid, index), torch.float32,
                                               stop - start, torch.device("cpu")))
                      for index, (start, stop) in enumerate(sub_groups(record.local_numel)))
            yield kind, torch.float32, chunks, record.owned_ranges(), None
        return
    state = optimizer.memory_state(slot)
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
        record = RUNTIME.store.lookup(param)
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
            "fp16_scaler": RUNTIME.store.group([param for _, param in named]).fp16_scaler.state(),  # this model's
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
    """A committed checkpoint folder, checked and indexed by (name, kind) -> pieces.

    The folder is untrusted input.  Every file it names (manifests, data
    files, ``extra``) must be a plain file name inside it and is opened
    without following a link; every field a load uses is checked before any
    data file is read: types, one manifest per saved rank, offsets and
    counts inside the data file, a tensor's pieces disjoint and inside it,
    values and buffers covered whole, RNG states restorable.  A defect is a
    ``ZinfCheckpointError`` naming the file and the entry.
    """

    def __init__(self, path: str, verify: bool = True):
        self.path = path
        marker = os.path.join(path, COMMIT_MARKER)
        if not os.path.lexists(marker):
            raise ZinfCheckpointError(_not_committed(path))
        try:
            meta_crc = int(read_checked(path, COMMIT_MARKER, None, "commit marker").decode().strip())
        except ValueError:
            raise ZinfCheckpointError(f"commit marker {marker} is damaged: the checkpoint is corrupt") from None
        meta_path = os.path.join(path, "meta.json")
        self.meta = read_json_checked(path, "meta.json", meta_crc, "checkpoint metadata")
        _check_meta(self.meta, meta_path)
        by_rank: dict[int, tuple[str, dict]] = {}
        for name, crc in sorted(self.meta["manifests"].items()):
            manifest_path = os.path.join(path, name)
            manifest = read_json_checked(path, name, crc, "checkpoint manifest", f"{meta_path}: manifests")
            rank = _check_manifest(manifest, manifest_path, self.meta)
            if rank in by_rank:
                raise _bad(manifest_path, "rank", f"is {rank}, as in {by_rank[rank][0]}")
            by_rank[rank] = (manifest_path, manifest)
        # _check_meta: as many manifests as ranks; _check_manifest: ranks below world_size, here distinct.
        ordered = [by_rank[rank] for rank in range(self.meta["world_size"])]
        self.manifests = [manifest for _, manifest in ordered]
        self.manifest_paths = [manifest_path for manifest_path, _ in ordered]
        self.data_paths = [os.path.join(path, manifest["data"]["file"]) for manifest in self.manifests]
        self.pieces: dict[tuple[str, str], list] = {}
        self.dtypes: dict[tuple[str, str], torch.dtype] = {}
        self.scalars: dict[str, dict] = {}
        for (manifest_path, manifest), data_path in zip(ordered, self.data_paths):
            for index, entry in enumerate(manifest["entries"]):
                key = (entry["name"], entry["kind"])
                dtype = DTYPES_BY_NAME[entry["dtype"]]
                if self.dtypes.setdefault(key, dtype) != dtype:
                    raise _bad(manifest_path, f"entries[{index}].dtype", f"is {entry['dtype']}, another manifest "
                               f"holds {entry['name']} ({entry['kind']}) as {DTYPE_NAMES[self.dtypes[key]]}")
                self.pieces.setdefault(key, []).extend(
                    (first, stop, data_path, offset, dtype) for first, stop, offset in entry["pieces"])
            for name, values in manifest["scalars"].items():
                self.scalars.setdefault(name, values)
        for pieces in self.pieces.values():
            pieces.sort()
        self._check_pieces()
        self.reader = RangeReader(follow_links=False)

    def _check_pieces(self) -> None:
        """A tensor's pieces must not overlap; a value or buffer must be covered whole."""
        sizes = {**{(name, "value"): info["shape"] for name, info in self.meta["params"].items()},
                 **{(name, "buffer"): info["shape"] for name, info in self.meta["buffers"].items()}}
        for (name, kind), shape in sizes.items():
            numel = math.prod(shape)
            covered = sum(stop - first for first, stop, *_ in self.pieces.get((name, kind), []))
            if covered != numel:
                raise ZinfCheckpointError(f"{self.path}: the manifests hold {covered:,} of the {numel:,} elements of "
                                          f"{name} ({kind}): the checkpoint is incomplete or damaged; load another "
                                          f"one")
        for (name, kind), pieces in self.pieces.items():
            for (_, stop, *_), (first, *_) in zip(pieces, pieces[1:]):
                if first < stop:
                    raise ZinfCheckpointError(f"{self.path}: two pieces of {name} ({kind}) both hold element "
                                              f"{first:,}: the checkpoint is damaged; load another one")

    def verify(self, comm) -> None:
        """Check every data file's blocks, the work split over ranks; all ranks raise the same error."""
        errors = []
        for index in range(len(self.manifests)):
            if index % comm.world_size != comm.rank:
                continue
            try:
                self.verify_data(index)
            except ZinfCheckpointError as err:
                errors.append(str(err))
        gathered = comm.all_gather_object(errors, "all_gather of checkpoint verification (load)")
        found = [message for messages in gathered for message in messages]
        if found:
            raise ZinfCheckpointError(f"load from {self.path} refused, nothing was changed: " + "; ".join(found))

    def verify_data(self, index: int) -> None:
        """Check the size and every block's CRC32 of the data file of rank ``index``."""
        verify_data_file(self.data_paths[index], self.manifests[index]["data"], self.manifest_paths[index])

    def has(self, name: str, kind: str) -> bool:
        """Whether the checkpoint holds any piece of ``name``'s ``kind`` (``"value"``, ``"buffer"``, ``"state.*"``)."""
        return (name, kind) in self.pieces

    def dtype(self, name: str, kind: str) -> torch.dtype:
        """The dtype the checkpoint holds ``name`` (``kind``) in."""
        return self.dtypes[(name, kind)]

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
        """The whole flat tensor ``name`` (``kind``) of ``numel`` elements, whatever world size wrote it."""
        return self.read_ranges(name, kind, [(0, numel, 0)], numel, dtype)

    def read_local(self, record: ParamRecord, name: str, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of ``name`` (``kind``) in this run's layout: the ranges ``record`` owns."""
        return self.read_ranges(name, kind, record.owned_ranges(), record.local_numel, dtype)

    def close(self) -> None:
        """Close the data files (the reader's open handles)."""
        self.reader.close()


# --- checks of a checkpoint's JSON (untrusted input) -------------------------------------


def _bad(where: str, field: str, problem: str) -> ZinfCheckpointError:
    return ZinfCheckpointError(f"{where}: {field} {problem}: the checkpoint is damaged or was not written by "
                               f"zinf.save; load another one (zinf.latest(folder) finds the newest complete one)")


def _shown(value) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_shape(value) -> bool:
    return isinstance(value, list) and all(_is_count(n) for n in value)


def _is_crc(value) -> bool:
    return _is_count(value) and value < 1 << 32


def _field(obj, key: str, check, expected: str, where: str, field: str):
    """``obj[key]``, which must pass ``check``; else raise naming the file (``where``) and ``field``."""
    if not isinstance(obj, dict):
        raise _bad(where, field.rpartition(".")[0] or "the file", f"is {_shown(obj)}, not an object")
    if key not in obj:
        raise _bad(where, field, "is missing")
    value = obj[key]
    if not check(value):
        raise _bad(where, field, f"is {_shown(value)}, not {expected}")
    return value


def _check_tensor_infos(meta: dict, key: str, where: str) -> None:
    infos = _field(meta, key, lambda v: isinstance(v, dict), "an object", where, key)
    for name, info in infos.items():
        _field(info, "shape", _is_shape, "a list of sizes", where, f"{key}[{name!r}].shape")
        _field(info, "dtype", lambda v: isinstance(v, str) and v in DTYPES_BY_NAME, "a dtype zinf saves", where,
               f"{key}[{name!r}].dtype")


def _check_meta(meta, where: str) -> None:
    """Check ``meta.json``: what :func:`load` and :func:`to_safetensors` use of it."""
    if not isinstance(meta, dict):
        raise _bad(where, "the file", f"is {_shown(meta)}, not an object")
    if meta.get("format") != FORMAT:
        raise ZinfCheckpointError(f"{where} is of format {_shown(meta.get('format'))}; this zinf reads {FORMAT!r}")
    world_size = _field(meta, "world_size", lambda v: _is_count(v) and v > 0, "a positive integer", where,
                        "world_size")
    _check_tensor_infos(meta, "params", where)
    _check_tensor_infos(meta, "buffers", where)
    manifests = _field(meta, "manifests", lambda v: isinstance(v, dict), "an object", where, "manifests")
    if len(manifests) != world_size:
        raise _bad(where, "manifests", f"names {len(manifests)} manifest(s) for a save by {world_size} rank(s)")
    for name, crc in manifests.items():
        check_file_name(name, "a manifest", f"{where}: manifests")
        _field(manifests, name, _is_crc, "a CRC32", where, f"manifests[{name!r}]")
    _field(meta, "fp16_scaler", lambda v: isinstance(v, dict), "an object", where, "fp16_scaler")
    _field(meta["fp16_scaler"], "scale", _is_number, "a number", where, "fp16_scaler.scale")
    for key in ("good_steps", "skipped_steps"):
        _field(meta["fp16_scaler"], key, _is_count, "a count", where, f"fp16_scaler.{key}")
    optimizer = _field(meta, "optimizer", lambda v: v is None or isinstance(v, dict), "null or an object", where,
                       "optimizer")
    if optimizer is not None:
        _field(optimizer, "class", lambda v: isinstance(v, str), "a class name", where, "optimizer.class")
        groups = _field(optimizer, "param_groups", lambda v: isinstance(v, list), "a list", where,
                        "optimizer.param_groups")
        for index, group in enumerate(groups):
            _field(group, "params", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
                   "a list of parameter names", where, f"optimizer.param_groups[{index}].params")
    if "extra" in meta:
        check_file_name(_field(meta, "extra", lambda v: isinstance(v, dict), "an object", where, "extra").get("file"),
                        "extra", f"{where}: extra.file")
        _field(meta["extra"], "crc32", _is_crc, "a CRC32", where, "extra.crc32")


def _check_manifest(manifest, where: str, meta: dict) -> int:
    """Check a rank's manifest against ``meta``; returns its rank."""
    if not isinstance(manifest, dict):
        raise _bad(where, "the file", f"is {_shown(manifest)}, not an object")
    if manifest.get("format") != FORMAT:
        raise _bad(where, "format", f"is {_shown(manifest.get('format'))}, not {FORMAT!r}")
    rank = _field(manifest, "rank", lambda v: _is_count(v) and v < meta["world_size"],
                  f"a rank below the saved world size {meta['world_size']}", where, "rank")
    data = _field(manifest, "data", lambda v: isinstance(v, dict), "an object", where, "data")
    check_file_name(data.get("file"), "its data file", f"{where}: data.file")
    check_data_description(data, where)
    data_bytes = data["bytes"]
    sizes = {**{(name, "value"): info["shape"] for name, info in meta["params"].items()},
             **{(name, "buffer"): info["shape"] for name, info in meta["buffers"].items()}}
    entries = _field(manifest, "entries", lambda v: isinstance(v, list), "a list", where, "entries")
    for index, entry in enumerate(entries):
        at = f"entries[{index}]"
        name = _field(entry, "name", lambda v: isinstance(v, str), "a name", where, f"{at}.name")
        kind = _field(entry, "kind", lambda v: v in ("value", "buffer") or (isinstance(v, str) and
                      v.startswith("state.") and len(v) > len("state.")), "value, buffer or state.<name>", where,
                      f"{at}.kind")
        shape = sizes.get((name, "value" if kind.startswith("state.") else kind))
        if shape is None:
            raise _bad(where, f"{at}.name", f"is {name!r}, which meta.json lists as no "
                       f"{'buffer' if kind == 'buffer' else 'parameter'}")
        numel = math.prod(shape)
        dtype = DTYPES_BY_NAME[_field(entry, "dtype", lambda v: isinstance(v, str) and v in DTYPES_BY_NAME,
                                      "a dtype zinf saves", where, f"{at}.dtype")]
        pieces = _field(entry, "pieces", lambda v: isinstance(v, list), "a list", where, f"{at}.pieces")
        for number, piece in enumerate(pieces):
            if not (isinstance(piece, list) and len(piece) == 3 and all(_is_count(n) for n in piece)):
                raise _bad(where, f"{at}.pieces[{number}]", f"is {_shown(piece)}, not [first, stop, offset]")
            first, stop, offset = piece
            if not first <= stop <= numel:
                raise _bad(where, f"{at}.pieces[{number}]", f"holds elements {first:,}-{stop:,} of {name}, which "
                           f"has {numel:,}")
            if offset + (stop - first) * dtype.itemsize > data_bytes:
                raise _bad(where, f"{at}.pieces[{number}]", f"ends at byte {offset + (stop - first) * dtype.itemsize:,}"
                           f" of {data['file']}, which has {data_bytes:,}")
    scalars = _field(manifest, "scalars", lambda v: isinstance(v, dict), "an object", where, "scalars")
    for name, values in scalars.items():
        if name not in meta["params"]:
            raise _bad(where, f"scalars[{name!r}]", "names no parameter of meta.json")
        _field(scalars, name, lambda v: isinstance(v, dict), "an object", where, f"scalars[{name!r}]")
        for kind, scalar in values.items():
            _field(values, kind, lambda v: _is_scalar(kind, v), "[value, dtype] of a scalar zinf saves", where,
                   f"scalars[{name!r}][{kind!r}]")
    _check_rng(_field(manifest, "rng", lambda v: isinstance(v, dict), "an object", where, "rng"), where)
    return rank


def _is_scalar(kind: str, scalar) -> bool:
    """``[value, dtype name]`` of a saved optimizer scalar; a step count is a finite non-negative number."""
    if not (isinstance(scalar, list) and len(scalar) == 2 and isinstance(scalar[1], str)):
        return False
    value, dtype_name = scalar
    if kind == "step" and not (_is_number(value) and 0 <= value < 2 ** 53):
        return False
    if dtype_name == "python":
        return True
    if dtype_name not in DTYPES_BY_NAME or not isinstance(value, (int, float, bool)):
        return False
    try:
        torch.tensor(value, dtype=DTYPES_BY_NAME[dtype_name])
    except (RuntimeError, OverflowError, TypeError, ValueError):
        return False
    return True


def _check_rng(rng: dict, where: str) -> None:
    """The RNG states must be ones :func:`_set_rng_state` can restore (checked on spare generators)."""
    try:
        torch.Generator().set_state(torch.frombuffer(bytearray.fromhex(rng["torch"]), dtype=torch.uint8))
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise _bad(where, "rng.torch", f"is not a torch RNG state ({type(err).__name__}: {err})") from None
    try:
        random.Random().setstate(_tupled(rng["python"]))
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        raise _bad(where, "rng.python", f"is not a Python RNG state ({type(err).__name__}: {err})") from None
    if "cuda" in rng:
        states = rng["cuda"]
        try:
            if not isinstance(states, list):
                raise TypeError("not a list")
            decoded = [bytes.fromhex(state) for state in states]
        except (TypeError, ValueError) as err:
            raise _bad(where, "rng.cuda", f"is not a list of CUDA RNG states ({err})") from None
        if torch.cuda.is_available():
            for device, state in enumerate(decoded[: torch.cuda.device_count()]):
                if len(state) != torch.cuda.get_rng_state(device).numel():
                    raise _bad(where, f"rng.cuda[{device}]", f"has {len(state)} bytes, not a CUDA RNG state of "
                               f"{torch.cuda.get_rng_state(device).numel()}")


def _counts_steps(optimizer) -> bool:
    """Whether the optimizer's state holds a step count beside its moments (Adam does; SGD's momentum not)."""
    return issubclass(getattr(optimizer, "inner_class", object), (torch.optim.Adam, torch.optim.AdamW))


def _hyper_problems(optimizer, saved_groups: list[dict]) -> list[str]:
    """Saved hyperparameters whose type differs from the optimizer's (a string lr, a 3-tuple of betas)."""
    problems = []

    def fits(current, saved) -> bool:
        if isinstance(current, torch.Tensor) and current.dim() == 0:
            current = current.item()
        if current is None:
            return saved is None or isinstance(saved, (bool, int, float, str))
        if isinstance(current, bool):
            return isinstance(saved, bool)
        if isinstance(current, (int, float)):
            return isinstance(saved, (int, float)) and not isinstance(saved, bool)
        if isinstance(current, str):
            return isinstance(saved, str)
        if isinstance(current, (tuple, list)):
            return isinstance(saved, list) and len(saved) == len(current) and all(map(fits, current, saved))
        return isinstance(saved, (bool, int, float, str)) or saved is None

    for index, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        for key, value in saved.items():
            if key != "params" and key in group and not fits(group[key], value):
                problems.append(f"param group {index}'s {key} is {_shown(value)} in the checkpoint, which cannot "
                                f"replace {group[key]!r}")
    return problems


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
    for ``extra``: True by default, as a checkpoint folder is untrusted input
    (every file it names must lie in it, every count and offset is checked);
    pass False only for a checkpoint you trust whose ``extra`` holds objects
    other than tensors and plain containers.
    """
    path = os.path.abspath(os.fspath(path))
    comm = RUNTIME.store.comm
    RUNTIME.store.collect()
    mesh = _model_mesh(model, "load")
    try:
        checkpoint = Checkpoint(path)
        error = None
    except ZinfCheckpointError as err:
        checkpoint, error = None, str(err)
    errors = comm.all_gather_object(error, "all_gather of checkpoint metadata checks (load)")
    if any(errors):
        if checkpoint is not None:
            checkpoint.close()
        raise ZinfCheckpointError(next(message for message in errors if message))
    try:
        checkpoint.verify(comm)
        _check_matches(checkpoint, model, optimizer)
        meta = checkpoint.meta
        extra = _read_extra(checkpoint, weights_only) if "extra" in meta else None
    except BaseException:
        checkpoint.close()
        raise
    _load_model(checkpoint, model)
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, meta["optimizer"]["param_groups"]):
            for key, value in saved.items():
                if key != "params":
                    group[key] = _tupled(value) if isinstance(value, list) else value
        optimizer.zero_grad()
        optimizer.attach_checkpoint(checkpoint, {id(p): name for name, p in _named_params(model)})
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if optimizer.bound or all(RUNTIME.store.lookup(p) is not None for p in params):
            optimizer.bind()  # the binding is final: apply the state now
    else:
        checkpoint.close()
    # Into this model's ledger (made now if it has none yet: its parameters join it when adopted).
    RUNTIME.store.group([param for _, param in _named_params(model)]).fp16_scaler.load_state(meta["fp16_scaler"])
    if meta["world_size"] == comm.world_size and mesh is None and "mesh" not in meta:
        _set_rng_state(checkpoint.manifests[comm.rank]["rng"])
    else:
        log.info("zinf.load: saved over %d rank(s)%s, loaded at %d%s: RNG states not restored",
                 meta["world_size"], " (files of one replica's shards)" if "mesh" in meta else "", comm.world_size,
                 f" over {mesh.describe()}" if mesh is not None else "")
    return extra


def _read_extra(checkpoint: Checkpoint, weights_only: bool) -> Any:
    """``extra``, read from the checkpoint folder (never through a link) and checked against its CRC32."""
    described = checkpoint.meta["extra"]
    data = read_checked(checkpoint.path, described["file"], described["crc32"], "checkpoint extra",
                        f"{os.path.join(checkpoint.path, 'meta.json')}: extra.file")
    extra_path = os.path.join(checkpoint.path, described["file"])
    try:
        return torch.load(io.BytesIO(data), weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if not weights_only:
            raise ZinfCheckpointError(f"checkpoint extra {extra_path} cannot be unpickled ({err})") from err
        raise ZinfCheckpointError(
            f"checkpoint extra {extra_path} holds objects that torch.load(weights_only=True) refuses to unpickle "
            f"({str(err).splitlines()[0] if str(err) else type(err).__name__}). Unpickling them can run any code: "
            f"only if you trust this checkpoint, pass zinf.load(..., weights_only=False), or save plain "
            f"containers of tensors and numbers as extra") from err
    except Exception as err:
        raise ZinfCheckpointError(f"checkpoint extra {extra_path} cannot be loaded ({type(err).__name__}: "
                                  f"{err})") from err


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
        record = RUNTIME.store.lookup(param)
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
            else:
                problems += _hyper_problems(optimizer, saved_opt["param_groups"])
        if _counts_steps(optimizer):
            stepless = sorted({name for name, kind in checkpoint.pieces if kind.startswith("state.")
                               and "step" not in checkpoint.scalars.get(name, {})})
            if stepless:
                problems.append(f"optimizer state of {stepless[:4]}{' ...' if len(stepless) > 4 else ''} has "
                                f"moments but no step count (the checkpoint is damaged)")
    if problems:
        raise ZinfCheckpointError(f"checkpoint {checkpoint.path} does not match the model: " + "; ".join(problems)
                                  + ". Nothing was changed.")


@torch.no_grad()
def _load_model(checkpoint: Checkpoint, model) -> None:
    named = _named_params(model)
    records = []
    for name, param in named:
        record = RUNTIME.store.lookup(param)
        if _sharded(record):
            records.append(record)
            if record.stage == 3:
                RUNTIME.store.assign_local(record, checkpoint.read_local(record, name, "value", record.holding_dtype))
                continue
            # Stages 1-2: the full parameter is in memory anyway; the master takes the saved fp32 values.
            full = checkpoint.read_full(name, "value", record.numel, record.holding_dtype)
            param.data.copy_(full.view(record.shape))
            RUNTIME.store.assign_full(record, full.view(record.shape))
            record.synced_version = param._version
        else:
            full = checkpoint.read_full(name, "value", param.numel(), param.dtype)
            param.copy_(full.view(param.shape))
        param.grad = None
    RUNTIME.store.drop_grads(records)
    for name, buffer in _named_buffers(model, {id(p) for _, p in named}):
        buffer.copy_(checkpoint.read_full(name, "buffer", buffer.numel(), buffer.dtype).view(buffer.shape))


def apply_optimizer_state(optimizer: ZinfOptimizer, checkpoint: Checkpoint, names: dict[int, str]) -> None:
    """Give a bound optimizer the checkpoint's state for its slots, in this run's layout.

    Called by the optimizer when it binds (see ZinfOptimizer.attach_checkpoint).
    Masters of sharded parameters are written again from the saved fp32
    values (a parameter adopted after :func:`load` took them from the full
    tensor, which may be lower precision).  Moments of NVMe-tier slots go
    straight to their swap files; the optimizer takes the rest and the step
    counts through :meth:`ZinfOptimizer.restore_state`.
    """
    memory_states, nvme_steps = {}, {}
    with torch.no_grad():
        for slot in optimizer.slots():
            name = names[id(slot.param)]
            record = slot.record
            if _sharded(record):
                RUNTIME.store.assign_local(record, checkpoint.read_local(record, name, "value", record.holding_dtype))
            if not slot.state_on_nvme:
                memory_states[slot] = _slot_state(checkpoint, slot, name)
                continue
            step = checkpoint.scalars.get(name, {}).get("step")
            steps = int(step[0]) if step is not None else 0
            if steps and record.owns_state:
                for kind in ("exp_avg", "exp_avg_sq"):
                    local = checkpoint.read_local(record, name, "state." + kind, torch.float32)
                    for index, (start, stop) in enumerate(sub_groups(record.local_numel)):
                        RUNTIME.store.write_swap(record.swap, state_key(kind, record.uid, index), local[start:stop])
                    del local
                nvme_steps[slot] = steps
    optimizer.restore_state(memory_states, nvme_steps)


def _slot_state(checkpoint: Checkpoint, slot, name: str) -> dict:
    """The inner optimizer's state for one in-memory slot, in this run's layout (empty: none saved)."""
    record = slot.record
    state = {}
    for kind, (value, dtype_name) in checkpoint.scalars.get(name, {}).items():
        state[kind] = value if dtype_name == "python" else torch.tensor(value, dtype=DTYPES_BY_NAME[dtype_name])
    kinds = [kind for (saved_name, kind) in checkpoint.pieces if saved_name == name and kind.startswith("state.")]
    for kind in kinds:
        dtype = checkpoint.dtype(name, kind)
        if _sharded(record):
            if not record.owns_state:
                return {}
            value = checkpoint.read_local(record, name, kind, dtype)
        else:
            value = checkpoint.read_full(name, kind, slot.param.numel(), dtype).view(slot.param.shape)
        state[kind[len("state."):]] = value
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
        folder = os.path.join(root, name)
        if name.endswith((".partial", ".old")) or not os.path.lexists(os.path.join(folder, COMMIT_MARKER)):
            continue
        try:
            saved_at = read_json_checked(folder, "meta.json", None, "checkpoint metadata")["saved_at"]
        except (ZinfCheckpointError, TypeError, KeyError):
            continue
        if not _is_number(saved_at):
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
        for index in range(len(checkpoint.manifests)):
            checkpoint.verify_data(index)
        meta = checkpoint.meta
        tensors = [(name, "value", info) for name, info in meta["params"].items()]
        tensors += [(name, "buffer", info) for name, info in meta["buffers"].items()]
        dtypes = {name: checkpoint.dtype(name, kind) if checkpoint.has(name, kind)
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
    comm = RUNTIME.store.comm
    rank = comm.rank
    RUNTIME.store.collect()
    _spanning_meshes(model, "export")  # (export gathers each parameter over its own mesh)
    module = _unwrap(model)
    named = _named_params(module)
    tensors = [(name, param) for name, param in named] + _named_buffers(module, {id(p) for _, p in named})
    entries = []
    for name, tensor in tensors:
        record = RUNTIME.store.lookup(tensor)
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
            record = RUNTIME.store.lookup(tensor)
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
                _save_config(config, path)
            fsync_dir(path)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    _barrier(comm, "export to " + path)
    return path


def _save_config(config, path: str) -> None:
    """``config.save_pretrained`` into a fresh private folder, its files then renamed into ``path``.

    ``save_pretrained`` opens ``config.json`` with a plain ``open``, which
    would write through a link planted at that name; a rename replaces the
    link instead.
    """
    private = tempfile.mkdtemp(prefix=".config-", dir=path)
    try:
        config.save_pretrained(private)
        for name in os.listdir(private):
            replace_into_place(os.path.join(private, name), os.path.join(path, name))
    finally:
        shutil.rmtree(private, ignore_errors=True)


@contextlib.contextmanager
def _gathered(record: ParamRecord):
    """The full parameter for the block (collective), released after it; never a second full copy."""
    unit = RUNTIME.store.unit([record])
    RUNTIME.store.gather_start(unit)
    try:
        yield RUNTIME.store.gather_wait(unit)[0]
    finally:
        RUNTIME.store.release(unit)
