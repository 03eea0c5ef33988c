"""Consolidated weights for the ecosystem: ``zinf.export`` from a live model, ``to_safetensors`` from a checkpoint."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch

from .. import tensor_parallel
from ..api import store_of, unwrap
from ..runtime.checkpoint_files import (DTYPES_BY_NAME, SafetensorsWriter, ZinfCheckpointError, fsync_dir,
                                        replace_into_place, write_json_atomic)
from ..runtime.model_group import ModelView
from ..runtime.store import ParamRecord
from . import pipeline_layout
from .model_state import named_buffers, named_params, spanning_meshes
from .reader import Checkpoint


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

    A pipeline stage's model (or its ``ZinfPipelineStage``), every rank
    passing its own: each stage writes ``model-0000k-of-0000n.safetensors``
    and global rank 0 ``model.safetensors.index.json`` (transformers' sharded
    layout), under the whole model's names where the stage module has
    ``whole_name(name)``.
    """
    if format != "safetensors":
        raise ValueError(f"zinf.export writes format='safetensors' only, not {format!r}")
    path = os.path.abspath(os.fspath(path))
    model = pipeline_layout.model_of(model)
    view = store_of(model)
    view.store.collect()
    stage = pipeline_layout.stage_of(view, model)
    if stage is None:
        _export_over(view.comm, view, path, model, dtype, "model.safetensors", write_config=True)
        return path
    # A pipeline: each stage writes its shard of the whole model's files, and an index names the file of each
    # tensor (transformers' sharded layout, which from_pretrained reads).
    world = view.comm
    layout = pipeline_layout.StageLayout(view, model, stage, "export")
    file_name = f"model-{layout.index + 1:05d}-of-{layout.count:05d}.safetensors"
    written = _export_over(layout.comm, view, path, model, dtype, file_name, write_config=layout.index == 0)
    stages = world.all_gather_object(written if layout.comm.rank == 0 else None, "all_gather of exported names")
    # (Checked on every rank, from what every rank has: an error raised by rank 0 alone would leave the others
    # waiting in the barrier below.)
    weight_map, total = {}, 0
    for entries in filter(None, stages):
        for name, nbytes, file in entries:
            if name in weight_map:
                raise ValueError(f"zinf.export: two pipeline stages hold a tensor named {name!r} (the stage "
                                 f"module's whole_name(name) gives a stage's tensors their whole model's names)")
            weight_map[name] = file
            total += nbytes
    if world.rank == 0:
        write_json_atomic(os.path.join(path, "model.safetensors.index.json"),
                          {"metadata": {"total_size": total}, "weight_map": weight_map})
        fsync_dir(path)
    _barrier(world, "export index to " + path)
    return path


def _export_over(comm, view: ModelView, path: str, model, dtype, file_name: str,
                 write_config: bool) -> list[tuple[str, int, str]]:
    """:func:`export` over the ranks of ``comm`` (every rank, or a pipeline stage's) into ``path``/``file_name``;
    the (name, bytes, file) of each tensor written.  A stage module's ``whole_name(name)``, if it has one, names
    its tensors as the whole model does."""
    rank = comm.rank
    spanning_meshes(view, model, "export", comm)  # (export gathers each parameter over its own mesh)
    module = unwrap(model)
    whole_name = getattr(module, "whole_name", lambda name: name)
    named = named_params(module)
    tensors = [(name, param) for name, param in named] + named_buffers(module, {id(p) for _, p in named})
    entries = []
    for name, tensor in tensors:
        record = view.lookup(tensor)
        shape = tuple(tensor_parallel.global_shape(tensor, record.shape if record is not None else tensor.shape))
        out_dtype = dtype if dtype is not None and tensor.is_floating_point() else (
            record.dtype if record is not None else tensor.dtype)
        entries.append((whole_name(name), out_dtype, shape))
    writer = None
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        writer = SafetensorsWriter(os.path.join(path, file_name), entries, {"format": "pt"})
    try:
        for (name, tensor), (out_name, out_dtype, _) in zip(tensors, entries):
            record = view.lookup(tensor)
            if record is not None and record.stage == 3:
                with _gathered(view, record) as full:  # a collective: every rank, in the same order
                    full = tensor_parallel.full_tensor(tensor, full.view(record.shape))  # (a DTensor: over tp too)
                    if writer is not None:
                        writer.write(out_name, full.to(out_dtype))
            elif writer is not None:
                writer.write(out_name, tensor.detach().to(out_dtype))
        if writer is not None:
            writer.close()
            config = getattr(module, "config", None)
            if write_config and config is not None and hasattr(config, "save_pretrained"):
                _save_config(config, path)
            fsync_dir(path)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    _barrier(comm, "export to " + path)
    return [(name, out_dtype.itemsize * int(torch.Size(shape).numel()), file_name)
            for name, out_dtype, shape in entries]


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
def _gathered(view: ModelView, record: ParamRecord):
    """The full parameter for the block (collective), released after it; never a second full copy."""
    unit = view.store.unit([record])
    view.store.gather_start(unit)
    try:
        yield view.store.gather_wait(unit)[0]
    finally:
        view.store.release(unit)


def _barrier(comm, what: str) -> None:
    """A barrier that works on every backend (an all-gather of nothing)."""
    comm.all_gather_object(None, f"barrier ({what})")


def to_safetensors(path: str | os.PathLike, out: str | os.PathLike) -> str:
    """Convert a checkpoint folder to one consolidated ``model.safetensors`` under ``out``; no model, no ranks.

    The converter to the ecosystem's formats: the fp32 values of every
    parameter (tied ones once) and every buffer, read and written one tensor
    at a time.  ``transformers`` and ``safetensors`` load the file, and so does
    ``torch.distributed.checkpoint`` through its ``HuggingFaceStorageReader``.
    Optimizer state stays in zinf's format.
    """
    path = os.path.abspath(os.fspath(path))
    if pipeline_layout.is_pipelined(path):
        raise ZinfCheckpointError(f"{path} is the checkpoint of a pipeline: convert each stage's folder "
                                  f"({pipeline_layout.stage_folder(path, 0)}, ...) on its own, or zinf.export the "
                                  f"stages' models (one file per stage and an index)")
    checkpoint = Checkpoint(path)
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
