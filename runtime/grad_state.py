"""One parameter's gradient on this rank, in one explicit state, and the moves between its states.

The gradient a backward reduces into this rank's shard lives where the
optimizer steps: an fp32 shard on the device or in host memory, or, for an
nvme optimizer tier, in the swap files ``grad.<uid>.<i>`` (one per optimizer
sub-group).  A :class:`Gradient` (``record.gradient``) is in one
:class:`GradState`, and only its methods move it, along
:data:`LEGAL_TRANSITIONS`:

    NONE -start-> IN_MEMORY -add, scale-> IN_MEMORY          (device, cpu, or nvme within nvme_grad_ram_bytes)
    NONE -start_arriving-> ARRIVING -landed-> IN_MEMORY      (off a GPU into pinned memory while backward goes on)
    NONE, ON_DISK -to_disk-> ON_DISK -written, scale-> ON_DISK  (nvme optimizer tier: the swap files)
    ON_DISK, LOST -lose-> LOST                               (a swap write or read of it failed)
    any -drop-> NONE                                         (opt.zero_grad(), or the parameter collected)

A LOST gradient's files hold a mix of writes: the step refuses it until
``drop`` discards it.  The accounting of bytes stays with the store, which
calls these moves (runtime/store_grads.py); checkpoint loading and the
optimizer reach the gradient through the store, never by setting fields
(tests/unit/test_structure.py checks that nothing else assigns them).

An nvme-tier parameter split into row tiles receives its gradient a tile at
a time, and the swap files take whole sub-groups: the tiles of one backward
collect in a host buffer (:meth:`Gradient.collect_tile`) until all have
arrived, whatever the state of what the files hold.
"""

from __future__ import annotations

import enum

import torch

from .ledger import ZinfStoreError


class GradState(enum.Enum):
    """Where a parameter's accumulated gradient shard is (see the module docstring)."""
    NONE = "none"  # no gradient since the last drop (opt.zero_grad())
    ARRIVING = "arriving"  # a whole shard in pinned memory, its copy off the device still in flight
    IN_MEMORY = "in memory"  # an fp32 shard where the optimizer steps: the device or host memory
    ON_DISK = "on disk"  # in the swap files; its squared norm kept, a multiplier applied when the step reads it
    LOST = "lost"  # a swap write or read of it failed: refused by the step until dropped


_G = GradState
# (from, to) -> the moves that may make it; any other move raises.
LEGAL_TRANSITIONS: dict[tuple[GradState, GradState], tuple[str, ...]] = {
    (_G.NONE, _G.IN_MEMORY): ("start",),
    (_G.NONE, _G.ARRIVING): ("start_arriving",),
    (_G.ARRIVING, _G.IN_MEMORY): ("landed",),
    (_G.IN_MEMORY, _G.IN_MEMORY): ("add", "scale"),
    (_G.NONE, _G.ON_DISK): ("to_disk",),
    (_G.ON_DISK, _G.ON_DISK): ("to_disk", "written", "scale"),
    (_G.ON_DISK, _G.LOST): ("lose",),
    (_G.LOST, _G.LOST): ("lose",),
}


# The same as (from, to, move) triples: one lookup per move (a step makes a few per parameter).
_LEGAL_MOVES = frozenset((source, target, move) for (source, target), moves in LEGAL_TRANSITIONS.items()
                         for move in moves)


class ZinfGradStateError(ZinfStoreError):
    """A gradient was asked to move in a way its state machine does not allow."""


class Gradient:
    """This rank's accumulated gradient of one parameter (see the module docstring)."""

    __slots__ = ("name", "_state", "_shard", "_arriving", "_sq_norm", "_multiplier", "_lost", "_tiles")

    def __init__(self, name: str):
        self.name = name  # the parameter's, for messages
        self._state = GradState.NONE
        self._shard: torch.Tensor | None = None  # IN_MEMORY, ARRIVING: the fp32 shard
        self._arriving = None  # ARRIVING: the copy off the device (a CopyWork), waited for by the first read
        self._sq_norm = 0.0  # ON_DISK: the squared norm of what the files hold, multiplier included
        self._multiplier = 1.0  # ON_DISK: what the step multiplies the files' gradient by when it reads it
        self._lost: BaseException | None = None  # LOST: the first failure
        self._tiles: tuple[torch.Tensor, set] | None = None  # an nvme tiled parameter's tiles of this backward

    def _move(self, move: str, target: GradState) -> None:
        if (self._state, target, move) not in _LEGAL_MOVES:
            raise ZinfGradStateError(f"the gradient of {self.name} cannot {move} from {self._state.value} to "
                                     f"{target.value}")
        self._state = target

    @property
    def state(self) -> GradState:
        """The state it is in (only the moves below change it)."""
        return self._state

    # --- what it holds ----------------------------------------------------------------

    @property
    def shard(self) -> torch.Tensor | None:
        """The fp32 shard in memory (None: none), its copy off the device waited for."""
        if self.state is GradState.ARRIVING:
            self.landed()
        return self._shard

    @property
    def shard_nowait(self) -> torch.Tensor | None:
        """The shard whether or not its copy off the device has landed (for a reader that waits on
        :attr:`arriving` itself, where it reads it)."""
        return self._shard

    @property
    def shard_bytes(self) -> int:
        """The bytes of the shard in memory, arrived or not (0: none); waits for nothing."""
        shard = self._shard
        return 0 if shard is None else shard.numel() * shard.element_size()

    @property
    def arriving(self):
        """The copy off the device still in flight (ARRIVING), else None."""
        return self._arriving

    @property
    def on_disk(self) -> bool:
        """Whether its swap files may hold something (ON_DISK, or LOST: files with a mix of writes)."""
        return self.state in (GradState.ON_DISK, GradState.LOST)

    @property
    def sq_norm(self) -> float:
        """ON_DISK: the squared L2 norm of the gradient the files hold, its multiplier applied."""
        return self._sq_norm

    @property
    def multiplier(self) -> float:
        """ON_DISK: the factor the step applies to the files' gradient as it reads it (clipping, scaling)."""
        return self._multiplier

    @property
    def lost(self) -> BaseException | None:
        """LOST: the failure that made the files incomplete, else None."""
        return self._lost

    def __bool__(self) -> bool:
        """Whether a gradient is accumulated (in memory, arriving, or in the swap files)."""
        return self.state is not GradState.NONE

    # --- moves --------------------------------------------------------------------------

    def start(self, shard: torch.Tensor) -> None:
        """The first gradient since the last drop: ``shard`` (fp32, where the optimizer steps) holds it."""
        self._move("start", GradState.IN_MEMORY)
        self._shard = shard

    def start_arriving(self, shard: torch.Tensor, copy) -> None:
        """The first gradient, being copied into ``shard`` by ``copy`` (in flight; waited for at the first read)."""
        self._move("start_arriving", GradState.ARRIVING)
        self._shard, self._arriving = shard, copy

    def landed(self) -> None:
        """Wait for the copy off the device; the shard is then in memory."""
        copy = self._arriving
        self._move("landed", GradState.IN_MEMORY)
        self._arriving = None
        copy.synchronize()

    def add(self, start: int, stop: int, reduced: torch.Tensor) -> None:
        """Add ``reduced`` into elements ``start:stop`` of the shard in memory."""
        shard = self.shard  # (an arriving one lands first)
        self._move("add", GradState.IN_MEMORY)
        shard[start:stop].add_(reduced.to(shard.device))

    def scale(self, factor: float) -> None:
        """Multiply the gradient by ``factor``: the shard in memory now; the files' when the step reads them
        (their squared norm scales with them).  Nothing to scale: nothing happens."""
        if self.state is GradState.NONE or self.state is GradState.LOST:
            return
        if self.on_disk:
            self._move("scale", GradState.ON_DISK)
            self._multiplier *= factor
            self._sq_norm *= factor * factor
            return
        shard = self.shard
        self._move("scale", GradState.IN_MEMORY)
        shard.mul_(factor)

    def to_disk(self) -> bool:
        """Writes of the gradient to its swap files begin (from here on the files may exist, and ``drop``
        deletes them).  Returns whether the files held a gradient already (the writes then add to it)."""
        accumulating = self.state is GradState.ON_DISK
        self._move("to_disk", GradState.ON_DISK)
        return accumulating

    def written(self, sq_norm: float) -> None:
        """Every sub-group of the files was written: they hold a gradient of squared norm ``sq_norm``, with no
        multiplier pending."""
        self._move("written", GradState.ON_DISK)
        self._sq_norm, self._multiplier = sq_norm, 1.0

    def lose(self, error: BaseException) -> None:
        """A swap write or read failed: the files hold a mix (the first failure is kept)."""
        self._move("lose", GradState.LOST)
        if self._lost is None:
            self._lost = error

    def collect_tile(self, tile: int, start: int, stop: int, reduced: torch.Tensor, local_numel: int,
                     tiles: int) -> tuple[torch.Tensor | None, int]:
        """Put one row tile's reduced slice into this backward's tile buffer (nvme tier, tiled parameter).

        Returns ``(whole, buffer_bytes)``: ``whole`` is the buffer once every one of ``tiles`` has arrived
        (the caller then writes it and no longer holds it), else None; ``buffer_bytes`` the host bytes a
        buffer made now takes (positive), gives back (negative, with ``whole``) or 0.
        """
        made = 0
        if self._tiles is None:
            self._tiles = (torch.zeros(local_numel, dtype=torch.float32), set())
            made = local_numel * 4
        collected, done = self._tiles
        collected[start:stop].copy_(reduced)
        done.add(tile)
        if len(done) < tiles:
            return None, made
        self._tiles = None
        return collected, made - local_numel * 4

    def drop(self) -> tuple[int, bool, int]:
        """Discard the gradient, whatever its state (NONE after): returns ``(shard bytes in memory, whether
        its swap files may exist, tile buffer bytes)`` so that the caller gives them back."""
        if self._state is GradState.NONE and self._tiles is None:
            return 0, False, 0  # (zero_grad on a parameter that got no gradient: the common case, kept short)
        if self._state is GradState.ARRIVING:
            self.landed()  # (a copy in flight still writes into the shard)
        shard_bytes, had_files = self.shard_bytes, self.on_disk
        tile_bytes = 0 if self._tiles is None else self._tiles[0].numel() * 4
        self._state = GradState.NONE
        self._shard = self._arriving = self._lost = self._tiles = None
        self._sq_norm, self._multiplier = 0.0, 1.0
        return shard_bytes, had_files, tile_bytes

    def __repr__(self) -> str:
        return f"Gradient({self.name}: {self.state.value})"
