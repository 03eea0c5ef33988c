"""``zinf.save``: each rank writes its shards, the ranks agree, rank 0 commits and publishes the folder atomically."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import zlib
from typing import Any

import torch

from .. import tensor_parallel
from ..api import store_of
from ..runtime.model_group import combined_scaler_state
from ..module_paths import names_by_tensor
from ..optim import Slot, StreamedState, ZinfOptimizer
from ..runtime.checkpoint_files import (DTYPE_NAMES, ChecksummedWriter, ZinfCheckpointError, create_new, fsync_dir,
                                        replace_into_place, write_file_atomic, write_json_atomic)
from ..runtime.model_group import ModelView
from . import pipeline_layout
from .format import COMMIT_MARKER, FORMAT, hyper, rng_state, tensor_chunks, write_ranges
from .model_state import check_optimizer, model_mesh, named_buffers, named_params, sharded, tp_mesh_of, tp_meta

log = logging.getLogger("zinf")


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None) -> str:
    """Write a checkpoint of ``model`` (and ``optimizer``) to the folder ``path``; every rank must call it.

    Each rank writes its own shards (fp32 masters, optimizer moments) from
    the tier they rest on; rank 0 adds buffers, parameters zinf does not
    shard, and ``extra`` (anything ``torch.save`` takes, e.g. a data loader
    or LR scheduler state; returned by :func:`load`).  RNG states are saved
    per rank.  The folder appears only once complete (see the module
    docstring); a checkpoint already at ``path`` is replaced.  Returns ``path``.

    A pipeline stage's model (or its ``ZinfPipelineStage``), each rank passing
    its own stage's: one folder for the whole pipeline, a stage folder per
    stage (pipeline_layout.py).
    """
    path = os.path.abspath(os.fspath(path))
    model = pipeline_layout.model_of(model)
    view = store_of(model)
    view.store.collect()
    stage = pipeline_layout.stage_of(view, model)
    if stage is not None:
        return _save_pipeline(view, path, model, optimizer, extra, stage)
    return _save_over(view.comm, view, path, model, optimizer, extra)


def _save_over(comm, view: ModelView, path: str, model, optimizer, extra) -> str:
    """:func:`save` over the ranks of ``comm`` (every rank, or a pipeline stage's)."""
    rank = comm.rank
    # The files are numbered by shard rank.  With replicas (HSDP) every replica holds the same
    # shards: the first writes them, the others only take part in the agreement.
    mesh = model_mesh(view, model, "save", comm)
    tp_mesh = tp_mesh_of(model)
    tp_rank = 0
    if tp_mesh is not None:
        # Tensor parallel: one file per rank, its pieces ranges of the whole tensors (tensor_parallel.global_ranges);
        # what every tp rank holds alike (plain and Replicate parameters) is written by tp rank 0 alone.
        file_rank, world_size, writes = comm.rank, comm.world_size, True
        tp_rank = tp_mesh.get_local_rank()
    elif mesh is None:
        file_rank, world_size, writes = comm.rank, comm.world_size, True
    else:
        file_rank, world_size = mesh.shard.rank, mesh.shard.world_size
        writes = mesh.replicate is None or mesh.replicate.rank == 0
    started = time.perf_counter()
    if optimizer is not None:
        check_optimizer(optimizer)
        optimizer.bind()
    staging = _prepare_staging(comm, path)
    outcome, failure = None, None
    written = None  # (manifest, its CRC32, data bytes) of a rank that writes
    try:
        if writes:
            manifest = _write_rank(view, staging, file_rank, model, optimizer, tp_rank)
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
            _commit(view, staging, path, model, optimizer, extra, world_size,
                    {written[0]: written[1] for written, _ in outcomes if written is not None}, mesh, tp_mesh)
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


def _save_pipeline(view: ModelView, path: str, model, optimizer, extra, stage: tuple[int, int]) -> str:
    """Every stage saves its model into its stage folder of ``<path>.partial`` over its own ranks; every rank then
    agrees, and global rank 0 writes ``extra``, the layout's meta.json and COMMITTED and publishes the folder."""
    world = view.comm
    layout = pipeline_layout.StageLayout(view, model, stage, "save")
    staging = _prepare_staging(world, path)
    failure, outcome = None, None
    try:
        _save_over(layout.comm, view, pipeline_layout.stage_folder(staging, layout.index), model, optimizer, None)
    except Exception as err:  # the other stages must hear of it
        outcome, failure = f"stage {layout.index}: {err}", err  # (the same on each of the stage's ranks)
    outcomes = world.all_gather_object(outcome, "all_gather of checkpoint outcomes (pipeline save)")
    failed = list(dict.fromkeys(message for message in outcomes if message is not None))
    if not failed and world.rank == 0:
        try:
            _commit_folder(staging, path, pipeline_layout.top_meta(layout, world.world_size), extra)
        except Exception as err:
            outcome, failure = f"committing (rank 0): {type(err).__name__}: {err}", err
    if not failed:
        committed = world.all_gather_object(outcome, "all_gather of the checkpoint commit (pipeline save)")[0]
        failed = [committed] if committed is not None else []
    if failed:
        if world.rank == 0:
            _remove(staging, quiet=True)
        raise ZinfCheckpointError(f"save of the pipeline ({layout.describe()}) to {path} failed; nothing was "
                                  f"committed (the previous checkpoint at that path, if any, is untouched): "
                                  + "; ".join(failed)) from failure
    return path


def _prepare_staging(comm, path: str) -> str:
    """``<path>.partial``, made empty by ``comm``'s rank 0 and agreed by every rank of ``comm``."""
    staging = path + ".partial"
    prepared = None
    if comm.rank == 0:
        try:
            _remove(staging)  # what a killed save left (a link there is removed, never followed)
            os.makedirs(staging)
        except OSError as err:
            prepared = f"cannot create {staging} ({err})"
    prepared = comm.all_gather_object(prepared, "all_gather of checkpoint staging (save)")[0]
    if prepared is not None:
        raise ZinfCheckpointError(f"save to {path} failed; nothing was written: {prepared}")
    return staging


def _write_extra(folder: str, extra) -> dict:
    """``extra`` into ``folder``/extra.pt, written whole and fsynced before it takes its name; its meta entry."""
    extra_path = os.path.join(folder, "extra.pt")
    with create_new(extra_path + ".tmp") as handle:
        torch.save(extra, handle)
        handle.flush()
        os.fsync(handle.fileno())
    replace_into_place(extra_path + ".tmp", extra_path)
    return {"file": "extra.pt", "crc32": _file_crc(extra_path)}


def _commit(view: ModelView, staging: str, path: str, model, optimizer, extra, world_size: int,
            manifests: dict[str, int], mesh, tp_mesh) -> None:
    """Rank 0: write ``extra``, ``meta.json`` and the commit marker into ``staging``, then publish it at ``path``."""
    meta = _meta(view, model, optimizer, world_size, manifests)
    if tp_mesh is not None:
        # Said for the reader: RNG states are restored only into the same layout.
        meta["tp"] = tp_meta(tp_mesh, world_size)
    elif mesh is not None:
        # Said for the reader: the files are the shard group's; RNG states are the writing replica's only.
        meta["mesh"] = {"replicas": mesh.replicate.world_size if mesh.replicate is not None else 1,
                        "shards": mesh.shard.world_size}
    _commit_folder(staging, path, meta, extra)


def _commit_folder(staging: str, path: str, meta: dict, extra) -> None:
    """Write ``extra`` (if any), ``meta.json`` and the commit marker into ``staging``, then publish it at ``path``."""
    if extra is not None:
        meta["extra"] = _write_extra(staging, extra)
    meta_crc = write_json_atomic(os.path.join(staging, "meta.json"), meta)
    write_file_atomic(os.path.join(staging, COMMIT_MARKER), f"{meta_crc}\n".encode())
    fsync_dir(staging)
    _publish(staging, path)


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


def _write_rank(view: ModelView, staging: str, rank: int, model, optimizer, tp_rank: int = 0) -> dict:
    writer = ChecksummedWriter(os.path.join(staging, f"rank-{rank:05d}.bin"))
    entries, scalars = [], {}
    try:
        named = named_params(model)
        for name, param in named:
            record = view.lookup(param)
            if tp_rank and not tensor_parallel.holds_own_slice(param):
                continue
            if sharded(record):
                pieces = write_ranges(writer, view.store.local_value_chunks(record),
                                      tensor_parallel.global_ranges(param, record.owned_ranges()))
                dtype = record.holding_dtype
            elif rank == 0:
                full = param.detach().reshape(-1)
                pieces = write_ranges(writer, tensor_chunks(full), [(0, full.numel(), 0)])
                dtype = full.dtype
            else:
                continue
            entries.append({"name": name, "kind": "value", "dtype": DTYPE_NAMES[dtype], "pieces": pieces})
        if rank == 0:
            for name, buffer in named_buffers(model, {id(p) for _, p in named}):
                full = buffer.detach().reshape(-1)
                entries.append({"name": name, "kind": "buffer", "dtype": DTYPE_NAMES[full.dtype],
                                "pieces": write_ranges(writer, tensor_chunks(full), [(0, full.numel(), 0)])})
        if optimizer is not None:
            names = {id(p): name for name, p in named}
            for slot in optimizer.slots():
                name = names.get(id(slot.param))
                if name is None:
                    raise ZinfCheckpointError("the optimizer holds a parameter that is not one of the model's; save "
                                              "a model together with the optimizer over its own parameters")
                if tp_rank and not tensor_parallel.holds_own_slice(slot.param):
                    continue
                for kind, dtype, chunks, ranges, scalar in _optimizer_state(optimizer, slot, rank):
                    if scalar is not None:
                        scalars.setdefault(name, {})[kind] = scalar
                    else:
                        entries.append({"name": name, "kind": "state." + kind, "dtype": DTYPE_NAMES[dtype],
                                        "pieces": write_ranges(writer, chunks, ranges)})
        data = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"format": FORMAT, "rank": rank, "data": data, "entries": entries, "scalars": scalars,
            "rng": rng_state()}


def _optimizer_state(optimizer: ZinfOptimizer, slot: Slot, rank: int):
    """(kind, dtype, chunks, ranges, scalar) of a slot's optimizer state on this rank, from ``optimizer.save_state``.

    Sharded slots give their local tensors with the record's owned ranges;
    unsharded ones (stage 0, or a parameter zinf does not shard) the full
    tensors, from rank 0.  Scalars (``step``) come as ``[value, dtype]``.
    """
    record = slot.record
    if not sharded(record) and rank != 0:
        return
    ranges = tensor_parallel.global_ranges(slot.param, record.owned_ranges()) if sharded(record) else None
    for kind, value in optimizer.save_state(slot):
        if isinstance(value, StreamedState):
            yield kind, value.dtype, value.chunks, ranges, None
        elif not isinstance(value, torch.Tensor):
            yield kind, None, None, None, [value, "python"]
        elif value.dim() == 0:
            yield kind, None, None, None, [value.item(), DTYPE_NAMES[value.dtype]]
        elif sharded(record):
            yield kind, value.dtype, tensor_chunks(value.reshape(-1)), ranges, None
        else:
            yield kind, value.dtype, tensor_chunks(value.reshape(-1)), [(0, value.numel(), 0)], None


def _meta(view: ModelView, model, optimizer, world_size: int, manifests: dict[str, int]) -> dict:
    named = named_params(model)
    aliases = names_by_tensor(model)
    params = {}
    for name, param in named:
        record = view.lookup(param)
        layout = None
        if record is not None:
            layout = {"stage": record.stage, "partition": record.partition,
                      "param_dtype": DTYPE_NAMES[record.compute_dtype], "param_tier": record.param_tier,
                      "opt_tier": record.opt_tier, "tile_rows": list(record.tile_rows) if record.tile_rows else None}
        shape = list(tensor_parallel.global_shape(param, record.shape if record is not None else param.shape))
        dtype = record.dtype if record is not None else param.dtype
        params[name] = {"shape": shape, "dtype": DTYPE_NAMES[dtype], "aliases": aliases.get(id(param), [name]),
                        "requires_grad": param.requires_grad, "layout": layout}
    buffers = {name: {"shape": list(b.shape), "dtype": DTYPE_NAMES[b.dtype]}
               for name, b in named_buffers(model, {id(p) for _, p in named})}
    meta = {"format": FORMAT, "world_size": world_size, "params": params, "buffers": buffers,
            "manifests": manifests, "saved_at": time.time(),
            # This model's loss scale (its groups', kept in step by its optimizer).
            "fp16_scaler": combined_scaler_state(group.fp16_scaler for group in view.groups),
            "optimizer": None}
    if optimizer is not None:
        names = {id(p): name for name, p in named}
        meta["optimizer"] = {
            "class": type(optimizer).__name__,
            "param_groups": [{**hyper(group), "params": [names[id(p)] for p in group["params"]]}
                             for group in optimizer.param_groups],
        }
    return meta

