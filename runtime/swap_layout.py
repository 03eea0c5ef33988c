"""Where an offloaded parameter's bytes sit in the swap files: key names, sub-groups and alignment.

The one home of these facts.  A parameter's own keys and sub-groups are
built from them once, in its plan (runtime/param_plan.py); the store, the
optimizer steps and the optimizer's save/load read them from the plan
(``shard_swap``, ``state_groups``, ``state_swap``, ``state_key``):

* ``ALIGNMENT``: O_DIRECT's block (bytes); swap pieces, pinned blocks and each
  master key's start are multiples of it;
* sub-groups: an nvme-tier slice's fp32 optimizer state (and its gradient) is
  cut into ranges of at most ``SUB_GROUP_NUMEL`` elements, one swap key each,
  so a step streams them (runtime/optim/nvme_adam.py);
* key names: ``<state>.<uid>.<index>`` for optimizer state and gradients of
  sub-group ``index`` (:func:`state_key`), ``param.<uid>`` for a parameter's
  shard (:func:`param_key`) and ``param.<uid>.t<tile>`` per row tile
  (:func:`tile_key`).

Pure layout: no state, no I/O, no torch.
"""

from __future__ import annotations

ALIGNMENT = 4096  # O_DIRECT reads and writes, the pinned pool's blocks (see aio.py, pinned.py)
SUB_GROUP_NUMEL = 16 * 1024 * 1024  # 64 MiB of fp32 per state tensor per group
STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")  # the optimizer states kept per sub-group


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`ALIGNMENT`."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def sub_groups(numel: int, group_numel: int = SUB_GROUP_NUMEL) -> list[tuple[int, int]]:
    """(start, stop) element ranges covering ``numel`` in order."""
    return [(start, min(start + group_numel, numel)) for start in range(0, numel, group_numel)] or [(0, 0)]


def state_key(name: str, uid: int, index: int) -> str:
    """The swap key of optimizer state ``name`` (master, exp_avg, exp_avg_sq, grad) of sub-group ``index``."""
    return f"{name}.{uid}.{index}"


def param_key(uid: int) -> str:
    """The swap key of parameter ``uid``'s shard (nvme tier, untiled or tiles packed without alignment)."""
    return f"param.{uid}"


def tile_key(uid: int, tile: int) -> str:
    """The swap key of row tile ``tile`` of parameter ``uid``'s shard (each tile block-aligned)."""
    return f"{param_key(uid)}.t{tile}"
