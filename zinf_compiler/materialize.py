"""Build a model straight into its offloaded shards: larger than RAM from the first byte.

``torch.compile`` adopts parameters at the first compiled call, which needs
the whole model in memory first.  For a model whose states do not fit, build
it on the meta device and let zinf materialize it one module at a time::

    with torch.device("meta"):
        model = GPT(cfg)                       # no memory: shapes only
    zinf.materialize(model, options, init_fn=model.init_weights)
    model = torch.compile(model, backend="zinf", options=options)

For each module, in ``model.modules()`` order, its own meta parameters and
buffers get real memory on the compute device, ``init_fn(module)`` fills them (default: the
module's ``reset_parameters()``), and each parameter is adopted by the store
with the tiers ``options`` name, so its shard goes to NVMe (or CPU) and the
full tensor's memory is given back (stage 3).  At most one module's
parameters are in memory at a time.  ``options`` must be the ones passed to
``torch.compile`` (the backend checks that they agree).

Contract for ``init_fn``: called once per module that has meta parameters
or buffers of its own (the model itself included), after they are
allocated and before they are sharded; it must fill every one of them
(buffers too: their values computed under the meta device are gone).  A
parameter shared by several modules (tied weights) stays in memory until
the last of them has been initialized, so the last initialization wins, as
with ``model.apply(init_fn)``.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Callable, Mapping

import torch

from .adoption import adopt, model_mesh, plan_offload
from .blueprint import default_device
from .module_paths import names_by_tensor
from .options import parse_options
from .runtime.aio import human_bytes
from .runtime.checkpoint_files import RangeReader, ZinfCheckpointError, open_safetensors
from .runtime.host_memory import trim
from .runtime.store import DTYPES
from .runtime.tiers import store_tier
from .tile_plan import tile_rows_for

log = logging.getLogger("zinf")


def materialize(store, model: torch.nn.Module, options: Mapping[str, Any] | None = None,
                init_fn: Callable[[torch.nn.Module], None] | None = None, device: torch.device | str | None = None,
                progress: bool = True, weights: str | os.PathLike | None = None) -> torch.nn.Module:
    """Allocate, initialize and shard ``model``'s meta-device parameters module by module into ``store`` (the
    parameter store that compiles of the model will find them in); returns ``model``.

    ``device``: the compute device the parameters belong to (where gathers
    put them); default the current CUDA device if there is one, else the CPU.

    ``weights``: a safetensors file, or a folder of them (a sharded
    Hugging Face checkpoint with its ``*.safetensors.index.json``), holding
    the model's state-dict names.  Each rank reads, for every parameter, only
    the element range its shard holds, straight into the shard: no full
    tensor of the file is read, and the parameter's own memory is never
    touched.  Buffers in the file are read whole.  Parameters and buffers the
    file lacks are initialized (``init_fn`` or ``reset_parameters``) and
    named in a warning, as ``from_pretrained`` does; a shape that differs is
    an error, raised before anything is allocated.
    """
    parsed = parse_options(options, comm=store.comm)
    if device is None:
        device = default_device()
    if parsed.stage != 3:
        raise ValueError(f"zinf.materialize shards parameters as it builds them, which needs stage=3 "
                         f"(got stage={parsed.stage}); build the model normally for stages 0-2")
    named = list(model.named_parameters())  # tied parameters once, under their first name
    meta = [(name, p) for name, p in named if p.is_meta]
    if not meta:
        raise ValueError("zinf.materialize: the model has no meta-device parameters; build it under "
                         "`with torch.device('meta'):` (a model already in memory is adopted by torch.compile)")
    files, names_by_id = {}, {}
    if weights is not None:
        files = open_safetensors(os.fspath(weights))
        names_by_id = names_by_tensor(model)
        _check_weights(files, names_by_id, meta, model, weights)
    reader = RangeReader()
    mesh = model_mesh(parsed, store.comm)
    from_file = {id(p) for _, p in meta if _stored(files, names_by_id, p) is not None}
    # The model's plan, made from the meta-device parameters: each real one is adopted by its meta one's plan.
    plans = plan_offload(store, [(name, p, _tile_rows(name, p, parsed, mesh)) for name, p in meta], parsed,
                         device=device, from_file=from_file)
    # One model group for the model: its parameters built here, and any built outside the meta device
    # (which torch.compile adopts later, into this group).
    group = store.claim([p for _, p in named if not p.is_meta], device_memory_limit=parsed.device_memory_limit,
                        collective_timeout=parsed.collective_timeout)
    name_by_id = {id(p): name for name, p in named}
    modules = list(model.modules())
    last_holder = {}  # id(meta param) -> index of the last module holding it
    for index, module in enumerate(modules):
        for param in module._parameters.values():
            if param is not None and param.is_meta:
                last_holder[id(param)] = index
    real_by_meta: dict[int, torch.nn.Parameter] = {}
    stored_by_real: dict = {}  # id(real param) -> its tensor in the weights file
    total = sum(p.numel() for _, p in meta)
    done = 0
    started = last_report = time.perf_counter()
    for index, module in enumerate(modules):
        ready = []  # parameters whose last holder is this module: sharded after its init
        for key, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue  # a parameter built outside the meta device: torch.compile adopts it
            real = real_by_meta.get(id(param))
            if real is None:
                real = torch.nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)
                real_by_meta[id(param)] = real
                stored = _stored(files, names_by_id, param)
                if stored is not None:
                    # Read into the shard at adoption; the full tensor's pages are never touched.
                    stored_by_real[id(real)] = stored
            module._parameters[key] = real
            if last_holder[id(param)] == index:
                ready.append((name_by_id[id(param)], real, plans[id(param)]))
        meta_buffers = [key for key, b in module._buffers.items() if b is not None and b.is_meta]
        buffers_from_file = []
        for key in meta_buffers:
            stored = _stored(files, names_by_id, module._buffers[key])
            module._buffers[key] = torch.empty_like(module._buffers[key], device=device)
            if stored is not None:
                buffers_from_file.append((module._buffers[key], stored))
        real_ids = {id(r) for r in real_by_meta.values()}
        if not meta_buffers and not any(id(p) in real_ids for p in module._parameters.values()):
            continue  # nothing of its own to fill (or only parameters built outside the meta device)
        own_params = [p for p in module._parameters.values() if p is not None and id(p) in real_ids]
        from_file = all(id(p) in stored_by_real for p in own_params) and len(buffers_from_file) == len(meta_buffers)
        if not from_file:
            with torch.no_grad():
                if init_fn is not None:
                    init_fn(module)
                elif hasattr(module, "reset_parameters"):
                    module.reset_parameters()
                elif ready:
                    raise ValueError(f"zinf.materialize: module {type(module).__name__} has parameters but no "
                                     f"reset_parameters(); pass init_fn to fill them")
        with torch.no_grad():
            for buffer, stored in buffers_from_file:
                buffer.copy_(stored.read(reader, 0, stored.numel).view(buffer.shape))
        for name, real, plan in ready:
            stored = stored_by_real.get(id(real))
            read_local = None
            if stored is not None:
                read_local = functools.partial(_read_local, stored, reader=reader)
            record = adopt(store, real, name, parsed, mesh, plan, group=group, read_local=read_local)
            store.release_full_storage([record])
            done += real.numel()
        if ready:
            trim()  # the full tensors just freed sit in glibc's heap otherwise: RSS would grow module by module
        now = time.perf_counter()
        if progress and now - last_report > 10:
            log.warning("zinf.materialize: %s of %s parameters sharded (%.0f s)", f"{done:,}", f"{total:,}",
                        now - started)
            last_report = now
    reader.close()
    if progress:
        log.warning("zinf.materialize: %s parameters (%s of fp32) sharded to param tier %s, optimizer tier %s "
                    "in %.1f s", f"{total:,}", human_bytes(4 * total), store_tier(parsed.offload_param),
                    store_tier(parsed.offload_optimizer), time.perf_counter() - started)
    return model


def _tile_rows(name: str, param: torch.Tensor, parsed, mesh) -> tuple[int, ...] | None:
    """The tile plan of a parameter built here (:func:`~zinf_compiler.tile_plan.tile_rows_for`, with no graph).

    Without the graph every weight over tile_threshold is laid out in tiles; one the graph does not
    multiply (an embedding) is then gathered whole from that layout: it costs only the planning.
    """
    return tile_rows_for(name, param.shape, param.numel() * DTYPES[parsed.param_dtype].itemsize, parsed,
                         mesh.shard.world_size, parsed.device_memory_limit, 0)


def _stored(files: dict, names_by_id: dict, tensor: torch.Tensor):
    for name in names_by_id.get(id(tensor), []):
        if name in files:
            return files[name]
    return None


def _check_weights(files: dict, names_by_id: dict, meta, model, weights) -> None:
    """Before anything is allocated: shapes agree; say which parameters and buffers the file lacks."""
    wrong, missing = [], []
    tensors = [(name, p) for name, p in meta] + [(name, b) for name, b in model.named_buffers() if b.is_meta]
    for name, tensor in tensors:
        stored = _stored(files, names_by_id, tensor)
        if stored is None:
            if id(tensor) in names_by_id:  # a non-persistent buffer is never in a weights file
                missing.append(name)
            continue
        if tuple(stored.shape) != tuple(tensor.shape):
            wrong.append(f"{stored.name}: {tuple(stored.shape)} in the file, {tuple(tensor.shape)} in the model")
    if wrong:
        raise ZinfCheckpointError(f"zinf.materialize: {weights} does not fit the model: " + "; ".join(wrong[:8])
                                  + (f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""))
    if missing:
        log.warning("zinf.materialize: %d tensor(s) not in %s are initialized instead: %s", len(missing), weights,
                    ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))


def _read_local(stored, record, reader: RangeReader) -> torch.Tensor:
    """This rank's slice of a weights-file tensor, in the record's layout and holding dtype."""
    local = torch.zeros(record.local_numel, dtype=record.holding_dtype)
    for first, stop, local_start in record.owned_ranges():
        local[local_start : local_start + stop - first].copy_(stored.read(reader, first, stop))
    return local
