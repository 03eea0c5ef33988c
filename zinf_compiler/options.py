"""Option parsing for the zinf backend.

Options come from ``torch.compile(..., options={...})`` and from ``ZINF_<NAME>``
environment variables; explicit options win over the environment.  Every value
is validated here, once, so that passes and the runtime can trust ``ctx.options``.
An unknown name or a bad value raises :class:`ZinfOptionError` naming the option,
what was given and what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import Any, Callable, Mapping

ENV_PREFIX = "ZINF_"
# ZINF_* variables that are not options but are read elsewhere (so not warned about).
OTHER_ENV_NAMES = {"ZINF_COST_PROFILE"}  # cost_model.py: "nominal" skips the machine probes


class ZinfOptionError(ValueError):
    """An option name or value the backend cannot accept."""


_SIZE_SUFFIXES = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_bytes(value: Any) -> int:
    """Parse a byte count: an int, or a string such as ``"256MiB"``, ``"1.5GB"``."""
    if isinstance(value, bool):
        raise ValueError("a byte count, not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a byte count must be >= 0")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _SIZE_SUFFIXES:
            return int(float(match.group(1)) * _SIZE_SUFFIXES[match.group(2).lower()])
    raise ValueError("a byte count such as 268435456, '256MiB' or '2GB'")


def _choice(*allowed: Any) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if isinstance(value, bool):  # True == 1 in Python: stage=True must not mean stage 1
            raise ValueError("one of " + ", ".join(repr(a) for a in allowed) + f", not the bool {value}")
        for candidate in allowed:
            if value == candidate or (isinstance(value, str) and str(candidate) == value.strip().lower()):
                return candidate
        raise ValueError("one of " + ", ".join(repr(a) for a in allowed))

    return parse


def _int_at_least(low: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError(f"an integer >= {low}")
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"an integer >= {low}") from None
        if number != float(value) or number < low:
            raise ValueError(f"an integer >= {low}")
        return number

    return parse


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ValueError("True or False")


def _fraction_or_bytes(value: Any) -> float | int:
    """A fraction in (0, 1] (a float, or a string such as ``"0.5"``) or a byte count (int or ``"2GiB"``)."""
    if isinstance(value, float) or (isinstance(value, str) and re.fullmatch(r"\s*(0?\.[0-9]+|1\.0*)\s*", value)):
        fraction = float(value)
        if 0.0 < fraction <= 1.0:
            return fraction
        raise ValueError("a fraction in (0, 1] or a byte count such as '2GiB'")
    try:
        nbytes = parse_bytes(value)
    except ValueError:
        raise ValueError("a fraction in (0, 1] such as 0.5, or a byte count such as '2GiB'") from None
    if nbytes == 0:
        raise ValueError("a fraction in (0, 1] or a byte count > 0")
    return nbytes


# host_memory="auto": this share of the memory available (MemAvailable), split among the node's ranks; the rest
# is left to the page cache the NVMe tier reads through and to other processes.
AUTO_SHARE = 0.9


def _budget(value: Any) -> int | float | str | None:
    """A memory budget: None, "auto", a fraction in (0, 1] of the memory available, or a byte count."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return _fraction_or_bytes(value)
    except ValueError:
        raise ValueError("a byte count such as '2GiB', a fraction in (0, 1] of the memory available such as 0.5, "
                         "'auto' or None") from None


def budget_bytes(budget: int | float | str, available: int | None, ranks_on_node: int) -> int:
    """Bytes of a parsed budget (:func:`_budget`): a byte count as it is; a fraction, or "auto" (:data:`AUTO_SHARE`),
    of the memory ``available`` (bytes; None: unknown, an error), split among ``ranks_on_node`` ranks."""
    if isinstance(budget, int):
        return budget
    if available is None:
        raise ZinfOptionError(f"host_memory={budget!r} is a share of the memory available, which this system does "
                              "not report (/proc/meminfo): give a byte count such as '8GiB'")
    share = AUTO_SHARE if budget == "auto" else float(budget)
    return int(available * share) // max(ranks_on_node, 1)


def _or_keyword(keyword: str, inner: Callable[[Any], Any], hint: str) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        if value is None and keyword == "none":
            return None
        if isinstance(value, str) and value.strip().lower() == keyword:
            return None if keyword == "none" else keyword
        try:
            return inner(value)
        except ValueError:
            raise ValueError(f"{hint} or {keyword!r}") from None

    return parse


def _path_or_none(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    raise ValueError("a folder path or None")


def _name_list(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError("a list of pass names or a comma-separated string")


def _mesh(value: Any):
    """None (the default group), a ProcessGroup, or a 1-D or 2-D DeviceMesh, as its validated groups
    ``(shard group, replicate group or None)``: :func:`parse_options` makes them a runtime MeshComm of the
    communicator it is handed (a MeshComm passes as it is)."""
    from .runtime.comm import MeshComm

    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, MeshComm):
        return value
    import torch.distributed as dist

    accepted = "None, a torch.distributed ProcessGroup, or a 1-D or 2-D DeviceMesh (dims: replicate, shard)"
    if isinstance(value, str) or not dist.is_available():
        raise ValueError(accepted + " (not settable from the environment)")
    if not dist.is_initialized():
        raise ValueError(accepted + " of an initialized torch.distributed (call init_process_group first)")
    if isinstance(value, dist.ProcessGroup):
        return (value, None)
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(value, DeviceMesh):
        if value.ndim == 1:
            return (value.get_group(0), None)
        if value.ndim == 2:
            if value.size(1) < 2:
                raise ValueError("a 2-D DeviceMesh with at least 2 ranks per shard group (dim 1); to replicate "
                                 "without sharding, use DistributedDataParallel")
            if value.size() != dist.get_world_size():
                raise ValueError(f"a 2-D DeviceMesh spanning every rank (this one has {value.size()} of "
                                 f"{dist.get_world_size()}); shard a subset of ranks with a 1-D mesh or a ProcessGroup")
            return (value.get_group(1), value.get_group(0))
        raise ValueError(f"{accepted}; got a {value.ndim}-D DeviceMesh (tensor parallel dims are not supported)")
    raise ValueError(f"{accepted}; got {type(value).__name__}")


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One option: its name, default, parser (raises ``ValueError`` saying what it accepts) and meaning."""

    name: str
    default: Any
    parse: Callable[[Any], Any]
    meaning: str


OPTION_SPECS: tuple[OptionSpec, ...] = (
    OptionSpec("stage", 3, _choice(0, 1, 2, 3), "ZeRO stage: shard nothing / optimizer / + grads / + params"),
    OptionSpec("partition", "allgather", _choice("allgather", "broadcast"),
               "split every param across ranks (allgather), or one owner rank per param (broadcast)"),
    OptionSpec("offload_param", "none", _choice("none", "cpu", "nvme"), "where parameter partitions rest"),
    OptionSpec("offload_optimizer", "none", _choice("none", "cpu", "nvme"),
               "where fp32 master weights and optimizer states rest"),
    OptionSpec("offload_activations", "none", _choice("none", "cpu", "nvme"),
               "where saved activation checkpoints rest"),
    OptionSpec("activation_checkpointing", "none", _choice("none", "block", "auto"),
               "recompute policy: none, block (recompute inside each repeated block, save block inputs), auto "
               "(save what fits activation_memory_budget; with offload_activations, recompute or offload each "
               "tensor, whichever the cost model finds cheaper)"),
    OptionSpec("activation_memory_budget", 0.5, _fraction_or_bytes,
               "with activation_checkpointing='auto': saved-activation bytes that may stay on the device, as a "
               "fraction of what the default partition saves (0.5) or a byte count"),
    OptionSpec("activation_offload_min_bytes", 64 * 1024, parse_bytes,
               "with offload_activations: saved activations smaller than this stay on the device"),
    OptionSpec("nvme_path", None, _path_or_none, "folder for swap files (created private)"),
    OptionSpec("param_dtype", "fp32", _choice("bf16", "fp16", "fp32"),
               "compute dtype of gathered params and grads; master weights stay fp32"),
    OptionSpec("tile_threshold", 256 * 1024**2, parse_bytes, "a matmul whose weight exceeds this many bytes is tiled"),
    OptionSpec("tile_factor", "auto", _or_keyword("auto", _int_at_least(1), "an integer >= 1"),
               "tiles per oversized matmul"),
    OptionSpec("bucket_bytes", 64 * 1024**2, parse_bytes,
               "gathered bytes one bucket of parameters (one all-gather, one reduce-scatter) may hold; "
               "0: one collective per parameter"),
    OptionSpec("prefetch_nc", 3, _int_at_least(0), "ops ahead to start NVMe->CPU reads"),
    OptionSpec("prefetch_cg", 2, _int_at_least(0), "ops ahead to start CPU->device copies"),
    OptionSpec("prefetch_gg", 1, _int_at_least(0), "ops ahead to start allgathers"),
    OptionSpec("max_live_bytes", "auto", _or_keyword("auto", parse_bytes, "a byte count"),
               "cap on device bytes gathered or in flight at once (auto: device_memory_limit, "
               "else half the free device memory)"),
    OptionSpec("device_memory_limit", None, _or_keyword("none", parse_bytes, "a byte count"),
               "device-memory budget the planner must fit"),
    OptionSpec("aio_block_size", 1024**2, parse_bytes, "NVMe request size"),
    OptionSpec("aio_queue_depth", 8, _int_at_least(1), "NVMe requests in flight"),
    OptionSpec("aio_threads", 4, _int_at_least(1), "NVMe worker threads"),
    OptionSpec("nvme_grad_ram_bytes", "auto", _or_keyword("auto", parse_bytes, "a byte count"),
               "with offload_optimizer='nvme': reduced gradients kept in CPU memory, up to this many bytes per "
               "process (4 per parameter), instead of swap files; saves a 4-byte write and read per parameter "
               "each step (auto: an eighth of the memory available at the first such compile, shared by the "
               "node's ranks; 0: every gradient in swap files)"),
    OptionSpec("host_memory", None, _budget,
               "host RAM this process may use (its models share it): bytes, a fraction of the memory available "
               "(0.5) or 'auto' (AUTO_SHARE of it), shared by the node's ranks.  As a budget over every option, "
               "zinf.plan(model, example_inputs, {'host_memory': ...}) chooses the stage, tiers, gradient RAM and "
               "RAM cache that fit it (zinf_compiler/budget.py; compile with its compile_options()).  At compile, "
               "with an 'nvme' offload_param or offload_optimizer: the RAM cache's budget (zinf_compiler/ram_cache.py:"
               " the states that save the most disk bytes per byte stay on the cpu tier, a quarter is left for "
               "activations and the process itself, unless ram_cache_bytes says the states' share); None: every "
               "state on its offload tier"),
    OptionSpec("ram_cache_bytes", None, _or_keyword("none", parse_bytes, "a byte count"),
               "with an 'nvme' offload: bytes of optimizer states and parameter shards the RAM cache keeps on the "
               "cpu tier (the rest stream from NVMe), instead of host_memory's quarter-headroom rule; zinf.plan "
               "sets it to what its host_memory budget leaves"),
    OptionSpec("overlap_optimizer", "auto", _or_keyword("auto", _boolean, "true or false"),
               "with the parameters and optimizer state on NVMe at stage 3 (and nvme_copies=2), or the optimizer "
               "state in host memory (offload_optimizer='cpu') at stages 2-3: step each parameter's optimizer "
               "state during backward, as its gradient lands, and commit it at opt.step() unless clipping that "
               "clips, an fp16 overflow or a later gradient voids it (then it steps after backward, as with "
               "False); the result is the same either way. auto: on for NVMe (the disk idles through backward "
               "otherwise: 1.02-1.32x faster steps on a CPU device, 1.21x on one H100; benchmarks/RESULTS.md); "
               "for host memory on beside an accelerator only (the host idles through its backward; on a CPU "
               "device the backward needs its cores)"),
    OptionSpec("nvme_copies", 2, _choice(2, 1),
               "copies of each swap file: 2 keeps the last good step through a failed write, 1 halves the disk"),
    OptionSpec("pinned_bytes", "auto", _or_keyword("auto", parse_bytes, "a byte count"),
               "size of the store's reused pinned buffer pool (the graph's NVMe reads, gradient writes)"),
    OptionSpec("collective_timeout", 600, _int_at_least(1),
               "seconds a collective waits for the other ranks before an error naming it (gloo; NCCL "
               "uses the process group's timeout)"),
    OptionSpec("rank_agreement", "call", _choice("call", "compile"),
               "at world size > 1, ranks exchange a fingerprint of the graph and options before each compiled "
               "call (forward and backward) and each compile that runs collectives, and raise naming what differs "
               "instead of pairing the wrong collectives; compile: only at compiles (saves a tiny all-gather, and "
               "on NCCL a host sync, per call)"),
    OptionSpec("mesh", None, _mesh,
               "the ranks to shard over: None (every rank), a ProcessGroup or a 1-D DeviceMesh (shard over its "
               "ranks), or a 2-D DeviceMesh (replicate, shard) spanning every rank: HSDP, parameters sharded within "
               "each row and gradients averaged across rows (not settable from the environment)"),
    OptionSpec("broadcast_buffers", True, _boolean,
               "at world size > 1, each compiled graph first copies rank 0's buffers (BatchNorm running "
               "statistics) to every rank, as DistributedDataParallel's default does; False: each rank keeps its own"),
    OptionSpec("lower", "inductor", _choice("inductor", "eager"),
               "how rewritten graphs run: Inductor, or the FX graph's own Python code"),
    OptionSpec("dump_dir", None, _path_or_none, "write inspection dumps here"),
    OptionSpec("trace_step", 2, _int_at_least(0),
               "with dump_dir: the optimizer step traced to trace.json and memory.png (0: none)"),
    OptionSpec("disable_passes", (), _name_list, "pass names to skip, e.g. 'schedule,tile'"),
)

SPECS_BY_NAME = {spec.name: spec for spec in OPTION_SPECS}

# Values that parse but whose feature this build does not have yet.  Refusing
# them loudly is better than training with a silently ignored flag.
NOT_IMPLEMENTED: dict[str, set[Any]] = {}


@dataclasses.dataclass(frozen=True)
class ZinfOptions:
    """The validated options of one ``torch.compile`` call (see the design's option table)."""

    stage: int
    partition: str
    offload_param: str
    offload_optimizer: str
    offload_activations: str
    activation_checkpointing: str
    activation_memory_budget: float | int
    activation_offload_min_bytes: int
    nvme_path: str | None
    param_dtype: str
    tile_threshold: int
    tile_factor: int | str
    bucket_bytes: int
    prefetch_nc: int
    prefetch_cg: int
    prefetch_gg: int
    max_live_bytes: int | str
    device_memory_limit: int | None
    aio_block_size: int
    aio_queue_depth: int
    aio_threads: int
    nvme_grad_ram_bytes: int | str
    host_memory: int | float | str | None  # bytes, a fraction of the available memory, or "auto": budget_bytes
    ram_cache_bytes: int | None
    overlap_optimizer: bool | str
    nvme_copies: int
    pinned_bytes: int | str
    collective_timeout: int
    rank_agreement: str
    mesh: Any  # runtime.comm.MeshComm, or None: the default group (parsed without a comm: its groups)
    broadcast_buffers: bool
    lower: str
    dump_dir: str | None
    trace_step: int
    disable_passes: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        """The options as a plain ``{name: value}`` dict (``dataclasses.asdict``): what the dump index records."""
        return dataclasses.asdict(self)


def _valid_names() -> str:
    return ", ".join(spec.name for spec in OPTION_SPECS)


def parse_options(
    options: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    known_passes: tuple[str, ...] | None = None,
    comm: Any = None,
) -> ZinfOptions:
    """Merge ``options`` over ``ZINF_*`` environment variables and validate every value.

    ``comm``: the process's default-group communicator (runtime/comm.py's ``Comm``, handed in by the
    backend), which turns the option ``mesh`` into the :class:`~zinf_compiler.runtime.comm.MeshComm` the
    runtime uses.  Without one (validating options only) a mesh is checked and kept as its groups,
    ``(shard group, replicate group or None)``.

    Raises :class:`ZinfOptionError` for an unknown option name (listing the valid
    ones; an unknown ``ZINF_*`` variable only warns), a value that does not parse (saying what is accepted, and whether it
    came from the environment), a value whose feature is not built yet, an
    unknown pass in ``disable_passes`` and contradictory combinations.
    """
    environ = os.environ if environ is None else environ
    options = dict(options or {})
    for name in options:
        if name not in SPECS_BY_NAME:
            raise ZinfOptionError(f"unknown zinf option {name!r}; valid options are: {_valid_names()}")
    for key in environ:
        if (key.startswith(ENV_PREFIX) and key[len(ENV_PREFIX):].lower() not in SPECS_BY_NAME
                and key not in OTHER_ENV_NAMES):
            # A warning, not an error: other tools may own ZINF_* names too.
            warnings.warn(
                f"ignoring environment variable {key}: not a zinf option; zinf reads ZINF_<NAME> "
                f"for NAME in: {_valid_names()}",
                stacklevel=2,
            )

    values: dict[str, Any] = {}
    for spec in OPTION_SPECS:
        env_key = ENV_PREFIX + spec.name.upper()
        if spec.name in options:
            raw, origin = options[spec.name], f"option {spec.name!r}"
        elif env_key in environ:
            raw, origin = environ[env_key], f"environment variable {env_key}"
        else:
            values[spec.name] = spec.default
            continue
        try:
            values[spec.name] = spec.parse(raw)
        except ValueError as err:
            raise ZinfOptionError(f"bad value {raw!r} for {origin}: expected {err}") from None

    for name, unbuilt in NOT_IMPLEMENTED.items():
        if values[name] in unbuilt:
            raise ZinfOptionError(
                f"option {name}={values[name]!r} is not implemented in this build of zinf; "
                f"use {name}={SPECS_BY_NAME[name].default!r}"
            )
    if known_passes is not None:
        for pass_name in values["disable_passes"]:
            if pass_name not in known_passes:
                raise ZinfOptionError(
                    f"disable_passes names unknown pass {pass_name!r}; passes are: {', '.join(known_passes)}"
                )
    if "partition" in values["disable_passes"] and values["stage"] == 3:
        raise ZinfOptionError(
            "disable_passes=['partition'] at stage=3: the partition pass is what gathers each parameter before "
            "its use, and at stage 3 a parameter holds no memory between uses; look at graphs without the pass "
            "at stage 2 or lower (their gradients then reach param.grad, and the optimizer reduces them there)")
    if values["offload_param"] != "none" and values["stage"] != 3:
        raise ZinfOptionError(
            f"offload_param={values['offload_param']!r} needs stage=3 (at stages 0-2 every rank keeps full "
            f"parameters on the device); got stage={values['stage']}"
        )
    if isinstance(values["mesh"], tuple) and comm is not None:
        values["mesh"] = comm.mesh(*values["mesh"])
    if values["mesh"] is not None and not _is_default_mesh(values["mesh"]) and values["stage"] == 0:
        raise ZinfOptionError(f"option mesh ({_describe_mesh(values['mesh'])}) needs stage 1, 2 or 3; stage 0 is plain "
                              f"data parallel over every rank (DistributedDataParallel takes a process_group)")
    if values["offload_optimizer"] != "none" and values["stage"] == 0:
        raise ZinfOptionError("offload_optimizer needs a sharded optimizer: stage 1, 2 or 3 (got stage=0)")
    if "nvme" in (values["offload_param"], values["offload_optimizer"], values["offload_activations"]) and not values["nvme_path"]:
        raise ZinfOptionError("an 'nvme' offload needs nvme_path: set options={'nvme_path': '/path/to/fast/disk'}")
    nvme_state = "nvme" in (values["offload_param"], values["offload_optimizer"])
    if values["host_memory"] is not None and not nvme_state:
        raise ZinfOptionError(
            "host_memory at compile sizes the RAM cache over the NVMe tier: it needs offload_param or "
            "offload_optimizer 'nvme'.  As a budget over every option, let zinf.plan choose them: "
            "p = zinf.plan(model, example_inputs, {'host_memory': ..., 'nvme_path': ...}), then "
            "torch.compile(model, backend='zinf', options=p.compile_options())")
    if values["ram_cache_bytes"] is not None and not nvme_state:
        raise ZinfOptionError("ram_cache_bytes sizes the RAM cache over the NVMe tier: it needs offload_param or "
                              "offload_optimizer 'nvme'")
    return ZinfOptions(**values)


def _is_default_mesh(mesh: Any) -> bool:
    """A MeshComm, or groups not yet made one (see :func:`_mesh`), that shards over the default group."""
    if isinstance(mesh, tuple):
        import torch.distributed as dist

        return mesh[1] is None and mesh[0] in (None, dist.GroupMember.WORLD)
    return mesh.is_default


def _describe_mesh(mesh: Any) -> str:
    """Words for a mesh's shape, as ``MeshComm.describe`` says them, for a MeshComm or its groups."""
    if not isinstance(mesh, tuple):
        return mesh.describe()
    import torch.distributed as dist

    shard, replicate = mesh
    if replicate is None:
        return f"a group of {dist.get_world_size(shard)} ranks"
    return f"a mesh of {dist.get_world_size(replicate)} replicas x {dist.get_world_size(shard)} shards"


def options_markdown() -> str:
    """The option table as Markdown (name, default, meaning): docs/options.md's summary, written by
    scripts/options_doc.py and compared with this by tests/unit/test_options_doc.py."""
    rows = ["| name | default | meaning |", "|---|---|---|"]
    rows += [f"| `{spec.name}` | `{spec.default!r}` | {spec.meaning.replace('|', '/')} |" for spec in OPTION_SPECS]
    return "\n".join(rows)


def describe_options() -> str:
    """The option table as text (for ``--help`` style output and errors)."""
    width = max(len(spec.name) for spec in OPTION_SPECS)
    return "\n".join(f"{spec.name:<{width}}  default={spec.default!r:<12} {spec.meaning}" for spec in OPTION_SPECS)
