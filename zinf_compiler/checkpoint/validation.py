"""Checks of a checkpoint's JSON (``meta.json`` and the rank manifests): untrusted input.

Every field a load uses is checked before any data file is read; a defect
is a ``ZinfCheckpointError`` naming the file and the field.  The checks of a
manifest's data description and of file names are in
``runtime/checkpoint_files.py`` (with the files they describe); the basic
predicates (``is_count``, ``is_crc``) have their one home there too.
"""

from __future__ import annotations

import json
import math
import random

import torch

from ..runtime.checkpoint_files import (DTYPES_BY_NAME, ZinfCheckpointError, check_data_description, check_file_name,
                                        is_count, is_crc)
from .format import FORMAT, tupled


def bad(where: str, field: str, problem: str) -> ZinfCheckpointError:
    """The error for a damaged checkpoint field: where, which field, what is wrong, and what to do."""
    return ZinfCheckpointError(f"{where}: {field} {problem}: the checkpoint is damaged or was not written by "
                               f"zinf.save; load another one (zinf.latest(folder) finds the newest complete one)")


def _shown(value) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_number(value) -> bool:
    """Whether ``value`` is a finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_shape(value) -> bool:
    return isinstance(value, list) and all(is_count(n) for n in value)


def _field(obj, key: str, check, expected: str, where: str, field: str):
    """``obj[key]``, which must pass ``check``; else raise naming the file (``where``) and ``field``."""
    if not isinstance(obj, dict):
        raise bad(where, field.rpartition(".")[0] or "the file", f"is {_shown(obj)}, not an object")
    if key not in obj:
        raise bad(where, field, "is missing")
    value = obj[key]
    if not check(value):
        raise bad(where, field, f"is {_shown(value)}, not {expected}")
    return value


def _check_tensor_infos(meta: dict, key: str, where: str) -> None:
    infos = _field(meta, key, lambda v: isinstance(v, dict), "an object", where, key)
    for name, info in infos.items():
        _field(info, "shape", _is_shape, "a list of sizes", where, f"{key}[{name!r}].shape")
        _field(info, "dtype", lambda v: isinstance(v, str) and v in DTYPES_BY_NAME, "a dtype zinf saves", where,
               f"{key}[{name!r}].dtype")


def check_meta(meta, where: str) -> None:
    """Check ``meta.json``: what :func:`load` and :func:`to_safetensors` use of it."""
    if not isinstance(meta, dict):
        raise bad(where, "the file", f"is {_shown(meta)}, not an object")
    if meta.get("format") != FORMAT:
        raise ZinfCheckpointError(f"{where} is of format {_shown(meta.get('format'))}; this zinf reads {FORMAT!r}")
    world_size = _field(meta, "world_size", lambda v: is_count(v) and v > 0, "a positive integer", where,
                        "world_size")
    _check_tensor_infos(meta, "params", where)
    _check_tensor_infos(meta, "buffers", where)
    manifests = _field(meta, "manifests", lambda v: isinstance(v, dict), "an object", where, "manifests")
    if len(manifests) != world_size:
        raise bad(where, "manifests", f"names {len(manifests)} manifest(s) for a save by {world_size} rank(s)")
    for name, crc in manifests.items():
        check_file_name(name, "a manifest", f"{where}: manifests")
        _field(manifests, name, is_crc, "a CRC32", where, f"manifests[{name!r}]")
    _field(meta, "fp16_scaler", lambda v: isinstance(v, dict), "an object", where, "fp16_scaler")
    _field(meta["fp16_scaler"], "scale", is_number, "a number", where, "fp16_scaler.scale")
    for key in ("good_steps", "skipped_steps"):
        _field(meta["fp16_scaler"], key, is_count, "a count", where, f"fp16_scaler.{key}")
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
        _field(meta["extra"], "crc32", is_crc, "a CRC32", where, "extra.crc32")


def check_manifest(manifest, where: str, meta: dict) -> int:
    """Check a rank's manifest against ``meta``; returns its rank."""
    if not isinstance(manifest, dict):
        raise bad(where, "the file", f"is {_shown(manifest)}, not an object")
    if manifest.get("format") != FORMAT:
        raise bad(where, "format", f"is {_shown(manifest.get('format'))}, not {FORMAT!r}")
    rank = _field(manifest, "rank", lambda v: is_count(v) and v < meta["world_size"],
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
            raise bad(where, f"{at}.name", f"is {name!r}, which meta.json lists as no "
                       f"{'buffer' if kind == 'buffer' else 'parameter'}")
        numel = math.prod(shape)
        dtype = DTYPES_BY_NAME[_field(entry, "dtype", lambda v: isinstance(v, str) and v in DTYPES_BY_NAME,
                                      "a dtype zinf saves", where, f"{at}.dtype")]
        pieces = _field(entry, "pieces", lambda v: isinstance(v, list), "a list", where, f"{at}.pieces")
        for number, piece in enumerate(pieces):
            if not (isinstance(piece, list) and len(piece) == 3 and all(is_count(n) for n in piece)):
                raise bad(where, f"{at}.pieces[{number}]", f"is {_shown(piece)}, not [first, stop, offset]")
            first, stop, offset = piece
            if not first <= stop <= numel:
                raise bad(where, f"{at}.pieces[{number}]", f"holds elements {first:,}-{stop:,} of {name}, which "
                           f"has {numel:,}")
            if offset + (stop - first) * dtype.itemsize > data_bytes:
                raise bad(where, f"{at}.pieces[{number}]", f"ends at byte {offset + (stop - first) * dtype.itemsize:,}"
                           f" of {data['file']}, which has {data_bytes:,}")
    scalars = _field(manifest, "scalars", lambda v: isinstance(v, dict), "an object", where, "scalars")
    for name, values in scalars.items():
        if name not in meta["params"]:
            raise bad(where, f"scalars[{name!r}]", "names no parameter of meta.json")
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
    if kind == "step" and not (is_number(value) and 0 <= value < 2 ** 53):
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
    """The RNG states must be ones :func:`set_rng_state` can restore (checked on spare generators)."""
    try:
        torch.Generator().set_state(torch.frombuffer(bytearray.fromhex(rng["torch"]), dtype=torch.uint8))
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise bad(where, "rng.torch", f"is not a torch RNG state ({type(err).__name__}: {err})") from None
    try:
        random.Random().setstate(tupled(rng["python"]))
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        raise bad(where, "rng.python", f"is not a Python RNG state ({type(err).__name__}: {err})") from None
    if "cuda" in rng:
        states = rng["cuda"]
        try:
            if not isinstance(states, list):
                raise TypeError("not a list")
            decoded = [bytes.fromhex(state) for state in states]
        except (TypeError, ValueError) as err:
            raise bad(where, "rng.cuda", f"is not a list of CUDA RNG states ({err})") from None
        if torch.cuda.is_available():
            for device, state in enumerate(decoded[: torch.cuda.device_count()]):
                if len(state) != torch.cuda.get_rng_state(device).numel():
                    raise bad(where, f"rng.cuda[{device}]", f"has {len(state)} bytes, not a CUDA RNG state of "
                               f"{torch.cuda.get_rng_state(device).numel()}")


def hyper_problems(optimizer, saved_groups: list[dict]) -> list[str]:
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

