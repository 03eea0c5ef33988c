"""zinf options from a DeepSpeed JSON config (issue 38, "Migration from DeepSpeed").

``zinf.options_from_deepspeed(config)`` takes the config as a dict or the path of its JSON file and
returns the ``options`` dict for ``torch.compile(model, backend="zinf", options=...)``.  What maps:

=====================================================================  ==========================================
DeepSpeed key                                                          zinf option
=====================================================================  ==========================================
``zero_optimization.stage`` (DeepSpeed's default 0)                   ``stage``
``zero_optimization.offload_param.device`` none / cpu / nvme          ``offload_param``
``zero_optimization.offload_optimizer.device`` none / cpu / nvme      ``offload_optimizer``
``zero_optimization.cpu_offload`` / ``cpu_offload_params`` (old)      ``offload_optimizer`` / ``offload_param`` cpu
``offload_param.nvme_path``, ``offload_optimizer.nvme_path``          ``nvme_path`` (one folder for both)
``bf16.enabled`` / ``fp16.enabled`` (neither: fp32)                    ``param_dtype`` bf16 / fp16
``zero_optimization.reduce_bucket_size``, ``allgather_bucket_size``,   ``bucket_bytes``: the smallest, in
``stage3_prefetch_bucket_size`` (elements)                             elements x ``param_dtype``'s bytes
``zero_optimization.stage3_max_live_parameters`` (elements)           ``max_live_bytes`` (x the same bytes)
``aio.block_size`` / ``aio.queue_depth``                               ``aio_block_size`` / ``aio_queue_depth``
``aio.thread_count`` (or ``intra_op_parallelism``)                     ``aio_threads``
=====================================================================  ==========================================

A key set to what zinf does anyway (``overlap_comm``, ``contiguous_gradients``, ``reduce_scatter``,
``allgather_partitions``, ``pin_memory``, ``aio.overlap_events`` true; ``fp16.loss_scale`` 0, dynamic
scaling; fp32 masters) passes silently.  Every other key is named, each with why, in one
:class:`DeepSpeedConfigWarning`: a setting zinf has no option for (``stage3_param_persistence_threshold``,
``sub_group_size``, ``max_in_cpu``, fp16 scaler settings, ...) and what belongs to the training loop
(``gradient_clipping``: call ``torch.nn.utils.clip_grad_norm_``; ``optimizer``, ``scheduler``, batch sizes).  Keys of a
``bf16`` / ``fp16`` section that is not enabled are inert in DeepSpeed too and are not named.
``"auto"`` (what the Hugging Face Trainer writes for it to fill in) takes zinf's default, noted in the
same warning.  A value zinf cannot honour raises :class:`ValueError` naming the key: an unknown offload
device, parameter offload below stage 3, an nvme device without ``nvme_path`` or two different folders,
both ``bf16`` and ``fp16`` enabled, a count that is not a whole number.  The result is checked by :func:`parse_options`.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Mapping

from .options import SPECS_BY_NAME, parse_options
from .runtime.records import DTYPES

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_OFFLOAD_SECTIONS = ("offload_param", "offload_optimizer")

# Keys zinf follows without an option when they hold this value (it does so always).
ZINF_BEHAVIOUR = {
    "zero_optimization.overlap_comm": True,
    "zero_optimization.contiguous_gradients": True,
    "zero_optimization.reduce_scatter": True,
    "zero_optimization.allgather_partitions": True,
    "zero_optimization.offload_param.pin_memory": True,
    "zero_optimization.offload_optimizer.pin_memory": True,
    "zero_optimization.cpu_offload_use_pin_memory": True,
    "aio.overlap_events": True,
    "fp16.loss_scale": 0,
    "fp16.auto_cast": False,
    "fp16.fp16_master_weights_and_grads": False,
    "bf16.bf16_master_weights_and_grads": False,
    "bf16.bf16_optimizer_states": False,
}

_FP16_SCALER = ("zinf's fp16 loss scale is dynamic, with no option: it starts at 2**16, halves on an overflow, "
                "which skips the step, and doubles after 2000 good steps")
_PINNED = "zinf stages host transfers in one pinned pool, sized by option pinned_bytes"
_LOOP = "the training loop's to set"
# Why zinf does not act on a key (others: "no zinf equivalent").
REASONS = {
    "zero_optimization.overlap_comm": "zinf always overlaps collectives with compute",
    "zero_optimization.contiguous_gradients": "zinf's buckets and gradient shards are always contiguous",
    "zero_optimization.reduce_scatter": "zinf always reduce-scatters gradients",
    "zero_optimization.allgather_partitions": "zinf always all-gathers; option partition='broadcast' is "
                                              "another layout, one owner rank per parameter",
    "zero_optimization.stage3_max_reuse_distance": "zinf's schedule releases a parameter after each use",
    "zero_optimization.stage3_param_persistence_threshold": "zinf shards every parameter at stage 3",
    "zero_optimization.sub_group_size": "the NVMe optimizer's sub-group size is fixed, in runtime/swap_layout.py",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        "gather with zinf.full_state_dict(model) or zinf.export",
    "zero_optimization.cpu_offload_use_pin_memory": _PINNED,
    "zero_optimization.offload_param.pin_memory": _PINNED,
    "zero_optimization.offload_optimizer.pin_memory": _PINNED,
    "zero_optimization.offload_param.buffer_count": _PINNED,
    "zero_optimization.offload_param.buffer_size": _PINNED,
    "zero_optimization.offload_optimizer.buffer_count": _PINNED,
    "zero_optimization.offload_param.max_in_cpu": "zinf keeps no NVMe parameters in RAM between uses",
    "zero_optimization.offload_optimizer.ratio": "zinf steps all of an offloaded optimizer where it rests",
    "zero_optimization.aio": "DeepSpeed reads aio at the top level of the config, not here",
    "aio.single_submit": "zinf's NVMe engine submits its requests its own way, in runtime/aio.py",
    "aio.overlap_events": "zinf's NVMe engine always overlaps requests",
    "fp16.loss_scale": "zinf has no static loss scale: " + _FP16_SCALER,
    "fp16.initial_scale_power": _FP16_SCALER,
    "fp16.loss_scale_window": _FP16_SCALER,
    "fp16.hysteresis": _FP16_SCALER,
    "fp16.consecutive_hysteresis": _FP16_SCALER,
    "fp16.min_loss_scale": _FP16_SCALER,
    "fp16.auto_cast": "wrap the forward in torch.autocast",
    "fp16.fp16_master_weights_and_grads": "zinf keeps fp32 master weights",
    "bf16.bf16_master_weights_and_grads": "zinf keeps fp32 master weights",
    "bf16.bf16_optimizer_states": "zinf keeps fp32 optimizer state",
    "gradient_clipping": "call torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) before opt.step()",
    "optimizer": "build zinf.optim.AdamW / Adam / SGD in the training loop",
    "scheduler": "use a torch.optim.lr_scheduler on the zinf optimizer",
    "train_batch_size": _LOOP,
    "train_micro_batch_size_per_gpu": _LOOP,
    "gradient_accumulation_steps": _LOOP + ": call backward that many times per opt.step()",
    "steps_per_print": _LOOP,
    "wall_clock_breakdown": "see option dump_dir's trace instead",
}


class DeepSpeedConfigWarning(UserWarning):
    """Keys of a DeepSpeed config that zinf does not act on, and its ``"auto"`` values, named."""


def options_from_deepspeed(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """zinf options for a DeepSpeed config (a dict, or the path of its JSON file): see the module docstring.

    Warns once (:class:`DeepSpeedConfigWarning`) naming each key it does not map and each ``"auto"``;
    raises :class:`ValueError` naming the key whose value zinf cannot honour."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as file:
            config = json.load(file)
    if not isinstance(config, Mapping):
        raise ValueError(f"a DeepSpeed config is a dict or a JSON file's path, not {type(config).__name__}")
    reading = _Reading()
    zero = reading.section(config, "zero_optimization")
    reading.take_stage(zero)
    dtype = _precision(reading, config)
    _offload(reading, zero)
    _sizes(reading, zero, dtype)
    _aio(reading, reading.section(config, "aio"))
    for key in config:
        if key not in ("zero_optimization", "aio", "bf16", "bfloat16", "fp16"):
            reading.unmapped(key, config[key])
    try:
        parse_options(reading.options, environ={})
    except ValueError as err:
        keys = [key for option, key in reading.sources.items() if option in str(err)]
        raise ValueError(f"DeepSpeed key {' / '.join(keys) or '?'}: zinf refuses the options it maps to: "
                         f"{err}") from None
    reading.warn()
    return reading.options


class _Reading:
    """One config's mapping under way: the options made, and the keys left unmapped or ``"auto"``."""

    def __init__(self):
        self.options: dict[str, Any] = {}
        self.sources: dict[str, str] = {}  # option -> the DeepSpeed key it came from
        self.skipped: list[str] = []
        self.notes: list[str] = []

    def section(self, parent: Mapping, name: str, path: str = "") -> dict:
        value = parent.get(name) or {}
        if not isinstance(value, Mapping):
            raise ValueError(f"DeepSpeed key {path + name!r} must be a dict, got {value!r}")
        return dict(value)

    def set(self, option: str, value: Any, source: str) -> None:
        """Set ``option`` from the DeepSpeed key ``source`` (named if zinf then refuses the value)."""
        self.options[option] = value
        self.sources[option] = source

    def take(self, section: dict, key: str, path: str, option: str | None) -> Any:
        """Pop ``key``: its value, or None where it is unset or ``"auto"`` (then noted: ``option``'s default)."""
        value = section.pop(key, None)
        if isinstance(value, str) and value.strip().lower() == "auto":
            default = f"{option}={SPECS_BY_NAME[option].default!r}" if option else "its default"
            self.notes.append(f"{path}{key}='auto' -> zinf's {default}")
            return None
        return value

    def unmapped(self, path: str, value: Any) -> None:
        """Name ``path`` in the warning, with why, unless ``value`` is what zinf does anyway."""
        known = path.replace("bfloat16.", "bf16.", 1)  # DeepSpeed's other name for the bf16 section
        if ZINF_BEHAVIOUR.get(known, object()) == value and not isinstance(value, str):
            return
        if isinstance(value, str) and value.strip().lower() == "auto":
            self.notes.append(f"{path}='auto' (nothing in zinf to fill: {REASONS.get(known, 'no zinf equivalent')})")
            return
        shown = json.dumps(value) if not isinstance(value, Mapping) else "{...}"
        self.skipped.append(f"{path}={shown} ({REASONS.get(known, 'no zinf equivalent')})")

    def unmapped_rest(self, section: dict, path: str) -> None:
        for key, value in section.items():
            self.unmapped(path + key, value)

    def take_stage(self, zero: dict) -> None:
        """``stage``: DeepSpeed's default (0) where unset, zinf's (3) where ``"auto"``."""
        stage = self.take(zero, "stage", "zero_optimization.", "stage") if "stage" in zero else 0
        if stage is None:
            return
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(f"DeepSpeed key 'zero_optimization.stage' must be 0, 1, 2 or 3, got {stage!r}")
        self.set("stage", int(stage), "zero_optimization.stage")

    def warn(self) -> None:
        parts = []
        if self.skipped:
            parts.append(f"zinf does not act on these DeepSpeed keys: {'; '.join(self.skipped)}")
        if self.notes:
            parts.append(f"defaults taken: {'; '.join(self.notes)}")
        if parts:
            warnings.warn("options_from_deepspeed: " + ". ".join(parts), DeepSpeedConfigWarning, stacklevel=3)


def _precision(reading: _Reading, config: Mapping) -> str:
    """``param_dtype`` from the ``bf16`` (or ``bfloat16``) and ``fp16`` sections; their other keys where enabled."""
    enabled = []
    for name, dtype in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        if name not in config:
            continue
        section = reading.section(config, name)
        on = reading.take(section, "enabled", f"{name}.", "param_dtype")
        if on is None and "enabled" in config[name]:
            continue  # "auto": zinf's default (fp32), noted
        if not isinstance(on, bool) and on is not None:
            raise ValueError(f"DeepSpeed key '{name}.enabled' must be true, false or \"auto\", got {on!r}")
        if on:
            enabled.append(f"{name}.enabled")
            reading.set("param_dtype", dtype, f"{name}.enabled")
            reading.unmapped_rest(section, f"{name}.")
    if len(enabled) > 1:
        raise ValueError(f"DeepSpeed keys {' and '.join(enabled)} are both true: choose one (DeepSpeed refuses "
                         f"both too)")
    return reading.options.get("param_dtype", SPECS_BY_NAME["param_dtype"].default)


def _offload(reading: _Reading, zero: dict) -> None:
    """``offload_param`` / ``offload_optimizer`` (and the old ``cpu_offload`` flags) and ``nvme_path``."""
    paths = {}
    for name in _OFFLOAD_SECTIONS:
        path = f"zero_optimization.{name}."
        section = reading.section(zero, name, "zero_optimization.")
        zero.pop(name, None)
        device = reading.take(section, "device", path, name)
        nvme_path = reading.take(section, "nvme_path", path, "nvme_path")
        if device is None:
            device = "none"
        if not isinstance(device, str) or device.strip().lower() not in OFFLOAD_DEVICES:
            raise ValueError(f"DeepSpeed key {path + 'device'!r} is {device!r}: zinf offloads to "
                             f"{', '.join(OFFLOAD_DEVICES)}")
        device = device.strip().lower()
        if device != "none":
            reading.set(name, device, path + "device")
        if device == "nvme":
            if not nvme_path:  # (DeepSpeed's code has no default folder either, whatever its docs say)
                raise ValueError(f"DeepSpeed key {path + 'device'!r} is 'nvme' but {path + 'nvme_path'!r} is "
                                 f"unset: name the folder for swap files")
            paths[path + "nvme_path"] = str(nvme_path)
        elif nvme_path is not None:
            section["nvme_path"] = nvme_path  # named: DeepSpeed ignores it too off nvme
        reading.unmapped_rest(section, path)
    for old, option in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param")):
        flag = zero.pop(old, None)
        if flag is True:
            if reading.options.get(option, "cpu") != "cpu":
                raise ValueError(f"DeepSpeed keys 'zero_optimization.{old}' and 'zero_optimization.{option}' "
                                 f"disagree: drop the old {old}")
            reading.set(option, "cpu", f"zero_optimization.{old}")
        elif flag not in (None, False):
            reading.unmapped(f"zero_optimization.{old}", flag)
    folders = set(paths.values())
    if len(folders) > 1:
        raise ValueError(f"DeepSpeed keys {' and '.join(paths)} name different folders ({', '.join(sorted(folders))}): "
                         f"zinf puts every swap file under one nvme_path")
    if folders:
        reading.set("nvme_path", folders.pop(), " / ".join(paths))
    stage = reading.options.get("stage", SPECS_BY_NAME["stage"].default)
    if reading.options.get("offload_optimizer", "none") != "none" and stage == 0:
        raise ValueError(f"DeepSpeed key 'zero_optimization.offload_optimizer.device' is "
                         f"{reading.options['offload_optimizer']!r}, which needs 'zero_optimization.stage' 1, 2 "
                         f"or 3; got stage 0")
    if reading.options.get("offload_param", "none") != "none" and stage != 3:
        raise ValueError(f"DeepSpeed key 'zero_optimization.offload_param.device' is "
                         f"{reading.options['offload_param']!r}, which needs 'zero_optimization.stage' 3 "
                         f"(DeepSpeed's rule too); got stage {stage}")


def _sizes(reading: _Reading, zero: dict, dtype: str) -> None:
    """``bucket_bytes`` and ``max_live_bytes`` from DeepSpeed's element counts; the rest of the section named."""
    itemsize = DTYPES[dtype].itemsize
    path = "zero_optimization."
    buckets = {}
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
        value = reading.take(zero, key, path, "bucket_bytes")
        if value is not None:
            buckets[key] = _count(value, path + key)
    if buckets:
        smallest = min(buckets, key=buckets.get)
        reading.set("bucket_bytes", buckets[smallest] * itemsize, path + smallest)
    live = reading.take(zero, "stage3_max_live_parameters", path, "max_live_bytes")
    if live is not None:
        key = path + "stage3_max_live_parameters"
        reading.set("max_live_bytes", _count(live, key) * itemsize, key)
    reading.unmapped_rest(zero, path)


def _aio(reading: _Reading, aio: dict) -> None:
    """The NVMe engine's request size, queue depth and threads; the rest of the section named."""
    for key, option in (("block_size", "aio_block_size"), ("queue_depth", "aio_queue_depth"),
                        ("thread_count", "aio_threads"), ("intra_op_parallelism", "aio_threads")):
        value = reading.take(aio, key, "aio.", option)
        if value is not None:
            reading.set(option, _count(value, "aio." + key), "aio." + key)
    reading.unmapped_rest(aio, "aio.")


def _count(value: Any, key: str) -> int:
    """A DeepSpeed count (JSON writes ``5e8`` as a float) as an int >= 0, or a ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value):
        raise ValueError(f"DeepSpeed key {key!r} must be a whole number >= 0, got {value!r}")
    return int(value)
