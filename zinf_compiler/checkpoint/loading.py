"""``zinf.load`` and ``zinf.latest``: a checkpoint into a model (and optimizer) of any world size and layout."""

from __future__ import annotations

import io
import logging
import os
import pickle
from collections.abc import Mapping
from typing import Any, Callable

import torch

from .. import tensor_parallel
from ..api import store_of
from ..optim import Slot, ZinfOptimizer
from ..runtime.checkpoint_files import DTYPES_BY_NAME, ZinfCheckpointError, read_checked, read_json_checked
from ..runtime.model_group import ModelView
from . import pipeline_layout
from .format import COMMIT_MARKER, set_rng_state, tupled
from .model_state import (check_optimizer, counts_steps, model_mesh, named_buffers, named_params, sharded, tp_mesh_of,
                          tp_meta)
from .reader import Checkpoint
from .validation import hyper_problems, is_number

log = logging.getLogger("zinf")


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

    A pipeline's checkpoint loads into its stages, each rank passing its own
    stage's model (or ``ZinfPipelineStage``): the number of stages must be the
    saved one; each stage's dp and tp may differ (pipeline_layout.py).
    """
    path = os.path.abspath(os.fspath(path))
    model = pipeline_layout.model_of(model)
    view = store_of(model)
    view.store.collect()
    stage = pipeline_layout.stage_of(view, model)
    if stage is not None:
        return _load_pipeline(view, path, model, optimizer, weights_only, stage)
    if pipeline_layout.is_pipelined(path):
        layout = pipeline_layout.read_top_meta(path)["pipeline"]
        raise ZinfCheckpointError(
            f"{path} is the checkpoint of a pipeline ({pipeline_layout.describe(layout)}): load it into the "
            f"pipeline's stages (each rank zinf.load(path, its stage's model, ...) once its ZinfPipelineStage is "
            f"built), or read one stage's model from its folder {pipeline_layout.stage_folder(path, 0)}, ...")
    return _load_over(view.comm, view.comm, view, path, model, optimizer, weights_only)


def _load_pipeline(view: ModelView, path: str, model, optimizer, weights_only: bool, stage: tuple[int, int]):
    """Each stage loads its folder over its own ranks; every check of every stage is agreed first."""
    world = view.comm
    layout = pipeline_layout.StageLayout(view, model, stage, "load")
    extra, error = None, None
    try:
        top = pipeline_layout.read_top_meta(path)
        if "pipeline" not in top:
            error = (f"{path} is not a pipeline's checkpoint (saved by a model that is no pipeline stage); this "
                     f"model is stage {layout.index} of a pipeline ({layout.describe()})")
        elif top["pipeline"]["stages"] != layout.count:
            error = (f"{path} was saved by a pipeline of {pipeline_layout.describe(top['pipeline'])}; this pipeline "
                     f"is {layout.describe()}. The number of stages must be the saved one (a stage folder holds its "
                     f"stage's parameters); the dp and tp of a stage may differ")
        elif "extra" in top:
            extra = _read_extra(path, top["extra"], weights_only)
    except ZinfCheckpointError as err:
        error = str(err)
    errors = world.all_gather_object(error, "all_gather of checkpoint layout checks (pipeline load)")
    if any(errors):
        raise ZinfCheckpointError(next(message for message in errors if message))
    _load_over(layout.comm, world, view, pipeline_layout.stage_folder(path, layout.index), model, optimizer,
               weights_only)
    return extra


def _load_over(comm, everyone, view: ModelView, path: str, model, optimizer, weights_only: bool) -> Any:
    """:func:`load` over the ranks of ``comm`` (every rank, or a pipeline stage's), every check agreed over the
    ranks of ``everyone`` before anything changes (a pipeline's other stages load other folders)."""
    mesh = model_mesh(view, model, "load", comm)
    try:
        checkpoint = Checkpoint(path)
        error = None
    except ZinfCheckpointError as err:
        checkpoint, error = None, str(err)
    errors = everyone.all_gather_object(error, "all_gather of checkpoint metadata checks (load)")
    if any(errors):
        if checkpoint is not None:
            checkpoint.close()
        raise ZinfCheckpointError(next(message for message in errors if message))
    problem = None
    try:
        checkpoint.verify(comm)
        _check_matches(view, checkpoint, model, optimizer)
        meta = checkpoint.meta
        extra = _read_extra(path, meta["extra"], weights_only) if "extra" in meta else None
    except ZinfCheckpointError as err:
        problem = err
    except BaseException:
        checkpoint.close()
        raise
    if everyone is not comm:  # the other stages' checks: all load, or none
        problems = everyone.all_gather_object(str(problem) if problem is not None else None,
                                              "all_gather of checkpoint checks (pipeline load)")
        if problem is None and any(problems):
            problem = ZinfCheckpointError(f"load from {path} refused, nothing was changed: another stage's "
                                          f"checkpoint is: " + next(message for message in problems if message))
    if problem is not None:
        checkpoint.close()
        raise problem
    _load_model(view, checkpoint, model)
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, meta["optimizer"]["param_groups"]):
            for key, value in saved.items():
                if key != "params":
                    group[key] = tupled(value) if isinstance(value, list) else value
        optimizer.zero_grad()
        optimizer.attach_state(_SavedOptimizerState(checkpoint, {id(p): name for name, p in named_params(model)},
                                                    view))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if optimizer.bound or all(view.lookup(p) is not None for p in params):
            optimizer.bind()  # the binding is final: apply the state now
    else:
        checkpoint.close()
    # Into this model's groups (store_of claimed the parameters in none yet: they join it when adopted).
    for group in view.groups:
        group.fp16_scaler.load_state(meta["fp16_scaler"])
    # RNG states: restored into the layout that saved them, each rank its own file's.
    tp_mesh = tp_mesh_of(model)
    if tp_mesh is not None:
        same_layout, files_rank = meta.get("tp") == tp_meta(tp_mesh, comm.world_size), comm.rank
    elif mesh is None:
        same_layout, files_rank = "mesh" not in meta and "tp" not in meta, comm.rank
    else:  # (a 1-D mesh over these ranks, as a pipeline stage's dp mesh: each rank wrote its file)
        same_layout = mesh.replicate is None and mesh.shard.world_size == comm.world_size and "tp" not in meta \
            and meta.get("mesh") == {"replicas": 1, "shards": mesh.shard.world_size}
        files_rank = mesh.shard.rank
    if meta["world_size"] == comm.world_size and same_layout:
        set_rng_state(checkpoint.manifests[files_rank]["rng"])
    else:
        log.info("zinf.load: saved over %d rank(s)%s, loaded at %d%s: RNG states not restored",
                 meta["world_size"], " (files of one replica's shards)" if "mesh" in meta else "", comm.world_size,
                 f" over {mesh.describe()}" if mesh is not None else "")
    return extra


def _read_extra(folder: str, described: dict, weights_only: bool) -> Any:
    """``extra`` (as meta.json ``described`` it), read from the checkpoint folder (never through a link) and checked
    against its CRC32."""
    data = read_checked(folder, described["file"], described["crc32"], "checkpoint extra",
                        f"{os.path.join(folder, 'meta.json')}: extra.file")
    extra_path = os.path.join(folder, described["file"])
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


def _check_matches(view: ModelView, checkpoint: Checkpoint, model, optimizer) -> None:
    meta = checkpoint.meta
    named = named_params(model)
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
        record = view.lookup(param)
        shape = list(tensor_parallel.global_shape(param, record.shape if record is not None else param.shape))
        if name in saved and saved[name]["shape"] != shape:
            shapes.append(f"{name} has shape {tuple(shape)}, the checkpoint {tuple(saved[name]['shape'])}")
    problems += shapes[:4] + ([f"{len(shapes) - 4} more shapes differ"] if len(shapes) > 4 else [])
    buffers = {name for name, _ in named_buffers(model, {id(p) for _, p in named})}
    if buffers != set(meta["buffers"]):
        problems.append(f"buffers differ: model only {sorted(buffers - set(meta['buffers']))}, checkpoint only "
                        f"{sorted(set(meta['buffers']) - buffers)}")
    if optimizer is not None:
        check_optimizer(optimizer)
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
                problems += hyper_problems(optimizer, saved_opt["param_groups"])
        if counts_steps(optimizer):
            stepless = sorted({name for name, kind in checkpoint.pieces if kind.startswith("state.")
                               and "step" not in checkpoint.scalars.get(name, {})})
            if stepless:
                problems.append(f"optimizer state of {stepless[:4]}{' ...' if len(stepless) > 4 else ''} has "
                                f"moments but no step count (the checkpoint is damaged)")
    if problems:
        raise ZinfCheckpointError(f"checkpoint {checkpoint.path} does not match the model: " + "; ".join(problems)
                                  + ". Nothing was changed.")


@torch.no_grad()
def _load_model(view: ModelView, checkpoint: Checkpoint, model) -> None:
    named = named_params(model)
    records = []
    for name, param in named:
        record = view.lookup(param)
        if sharded(record):
            records.append(record)
            if record.stage == 3:
                view.store.assign_local(record, checkpoint.read_local(record, param, name, "value", record.holding_dtype))
                continue
            # Stages 1-2: the full parameter is in memory anyway; the master takes the saved fp32 values.
            full = checkpoint.read_full(name, "value", record.numel, record.holding_dtype)
            param.data.copy_(full.view(record.shape))
            view.store.assign_full(record, full.view(record.shape))
            view.store.mark_synced(record)
        elif tensor_parallel.layout_of(param) is not None:  # (not adopted yet) its TP-local slice of the whole
            local = tensor_parallel.local_of(param)
            local.copy_(checkpoint.read_ranges(name, "value", tensor_parallel.global_ranges(
                param, [(0, local.numel(), 0)]), local.numel(), local.dtype).view(local.shape))
        else:
            full = checkpoint.read_full(name, "value", param.numel(), param.dtype)
            param.copy_(full.view(param.shape))
        param.grad = None
    view.store.drop_grads(records)
    for name, buffer in named_buffers(model, {id(p) for _, p in named}):
        buffer.copy_(checkpoint.read_full(name, "buffer", buffer.numel(), buffer.dtype).view(buffer.shape))


class _SavedOptimizerState:
    """A checkpoint's optimizer state, handed to the optimizer by :func:`load` (``ZinfOptimizer.attach_state``).

    The optimizer applies it when it binds to the view's shards (again if it
    binds anew before its first step: parameters adopted after the load), and
    closes it at its first step.
    """

    def __init__(self, checkpoint: Checkpoint, names: dict[int, str], view: ModelView):
        self.checkpoint = checkpoint
        self.names = names  # each parameter's name in the checkpoint, by id(param)
        self.view = view

    @torch.no_grad()
    def apply(self, optimizer: ZinfOptimizer) -> None:
        """Give a bound optimizer the checkpoint's state for its slots, in this run's layout.

        Masters of sharded parameters are written again from the saved fp32
        values, through the view wherever they rest (a parameter adopted after
        :func:`load` took them from the full tensor, which may be lower
        precision); the moments and step counts go through
        :meth:`ZinfOptimizer.load_state`.
        """
        for slot in optimizer.slots():
            if sharded(slot.record):
                value = self.checkpoint.read_local(slot.record, slot.param, self.names[id(slot.param)], "value",
                                                   slot.record.holding_dtype)
                self.view.store.assign_local(slot.record, value)
        optimizer.load_state((slot, self._slot_state(slot)) for slot in optimizer.slots())

    def close(self) -> None:
        self.checkpoint.close()

    def _slot_state(self, slot: Slot) -> Mapping[str, Any]:
        """The saved state of one slot, in this run's layout (empty: none saved, or not this rank's).

        An NVMe-tier slot's moments are read when the optimizer looks them up
        (one at a time, as it writes each to its swap files).
        """
        checkpoint, name, record = self.checkpoint, self.names[id(slot.param)], slot.record
        if slot.state_on_nvme:
            step = checkpoint.scalars.get(name, {}).get("step")
            steps = int(step[0]) if step is not None else 0
            if not steps or not record.owns_state:
                return {}
            return _ReadOnLookup({"step": steps},
                                 lambda kind: checkpoint.read_local(record, slot.param, name, "state." + kind,
                                                                    torch.float32))
        state = {}
        for kind, (value, dtype_name) in checkpoint.scalars.get(name, {}).items():
            state[kind] = value if dtype_name == "python" else torch.tensor(value, dtype=DTYPES_BY_NAME[dtype_name])
        kinds = [kind for (saved_name, kind) in checkpoint.pieces if saved_name == name and kind.startswith("state.")]
        for kind in kinds:
            dtype = checkpoint.dtype(name, kind)
            if sharded(record):
                if not record.owns_state:
                    return {}
                value = checkpoint.read_local(record, slot.param, name, kind, dtype)
            else:
                value = checkpoint.read_full(name, kind, slot.param.numel(), dtype).view(slot.param.shape)
            state[kind[len("state."):]] = value
        return state


class _ReadOnLookup(Mapping):
    """Scalars held, and any other kind read by ``read(kind)`` each time it is looked up (never kept)."""

    def __init__(self, scalars: dict[str, Any], read: Callable[[str], torch.Tensor]):
        self.scalars, self.read = scalars, read

    def __getitem__(self, kind: str):
        return self.scalars[kind] if kind in self.scalars else self.read(kind)

    def __iter__(self):
        return iter(self.scalars)

    def __len__(self) -> int:
        return len(self.scalars)


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
        if not is_number(saved_at):
            continue
        if best is None or saved_at > best[0]:
            best = (saved_at, os.path.join(root, name))
    return best[1] if best else None
