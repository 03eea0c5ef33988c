"""The fp32 masters the graph's fetch read, kept for the early optimizer step ("master read once").

Why: an fp32 parameter resting on NVMe with its optimizer there
(``ParamPlan.params_in_master``) has no file of its own: the backward's fetch
reads its master, and the early step (runtime/optim/early_adam.py) would read the
same bytes again a moment later.  Kept here, they are read once: 16 bytes
per parameter a step (master and two moments read, the fetch's 4 included)
instead of 20.
"""

from __future__ import annotations

import collections

from .nvme_adam import SubGroup
from ..trace import now


class FetchedMasters:
    """Master sub-groups the graph's last fetch of each parameter read, kept for its early step.

    A fetch's bytes are copied into a buffer of the early step's pool (taken
    without waiting); the step takes that buffer as its sub-group's master
    and reads only the moments.  Every graph fetch offers its bytes, the
    forward's too: the backward's first fetches may be issued in forward, and
    a parameter the backward does not fetch (a bias) has only the forward's.
    The newest copies are kept: a fetch replaces its parameter's older copy
    (the backward's fetch replaces the forward's, the recompute's under
    activation checkpointing too) and makes room by
    dropping the oldest; where there is no room, no copy, and the step reads
    the disk as before.  A copy counts only while its key's good copy on disk
    is the one it was read from (``AioEngine.good_copy``): held writes of the
    step in flight do not change it, a committed step does, and
    :meth:`EarlyAdam.commit` drops them all.  No memory beyond the pool.
    """

    def __init__(self, tracer):
        self.tracer = tracer  # the process's: each reuse is drawn on the optimizer io track
        self.kept: collections.OrderedDict = collections.OrderedDict()  # (uid, index) -> (PinnedBuffer, token)
        self.stats = {"kept": 0, "reused": 0, "reused_bytes": 0, "dropped": 0}

    def offer(self, pool, record, staging, offset: int, reads) -> None:
        """Keep a copy of each master sub-group in ``staging`` (see :meth:`EarlyAdam.fetched_master`), in
        buffers of ``pool`` (the early step's)."""
        view = staging.memoryview()
        for index, (key, start, numel) in enumerate(reads):
            if key != record.plan.state_key("master", index):
                return  # not the master's layout (never for params_in_master): keep nothing
            slot, nbytes = (record.uid, index), numel * 4
            previous = self.kept.pop(slot, None)
            buffer = (previous[0] if previous is not None else
                      self.making_room(lambda: try_acquire(pool, nbytes), pool, only_when_idle=False))
            if buffer is None:
                continue
            at = offset + start * 4
            buffer.memoryview()[:nbytes] = view[at : at + nbytes]
            self.kept[slot] = (buffer, record.swap.good_copy(key))
            self.stats["kept"] += 1

    def making_room(self, take, pool, only_when_idle: bool, but: SubGroup | None = None):
        """``take()``'s first truthy result (an attempt on ``pool`` that does not wait), dropping the oldest
        kept copies (not ``but``'s) between attempts; None where dropping frees nothing more.  With
        ``only_when_idle`` copies are dropped only while the pool holds nothing else: a buffer in other use
        comes back without this, and a copy is worth more than an earlier start."""
        while True:
            taken = take()
            if taken:
                return taken
            if only_when_idle and pool.in_use_bytes > self.kept_bytes:
                return None
            if not self.drop_oldest(but=but):
                return None

    @property
    def kept_bytes(self) -> int:
        """Pool bytes the copies hold."""
        return sum(buffer.nbytes for buffer, _ in self.kept.values())

    def has(self, group: SubGroup) -> bool:
        """Whether a current copy of ``group``'s master is kept (a stale one is dropped)."""
        entry = self.kept.get((group.record.uid, group.index))
        if entry is None:
            return False
        if group.record.swap.good_copy(group.record.plan.state_key("master", group.index)) is entry[1]:
            return True
        self._drop((group.record.uid, group.index))
        return False

    def take(self, group: SubGroup):
        """The kept master buffer of ``group`` (checked by :meth:`has`), now the group's."""
        buffer, _ = self.kept.pop((group.record.uid, group.index))
        moment = now()
        self.tracer.interval("optimizer io", f"master.{group.record.uid}.{group.index} from the fetch", moment, moment)
        self.stats["reused"] += 1
        self.stats["reused_bytes"] += group.numel * 4
        return buffer

    def drop_oldest(self, but: SubGroup | None = None) -> bool:
        """Give back the oldest copy (not ``but``'s); whether there was one."""
        spared = None if but is None else (but.record.uid, but.index)
        slot = next((slot for slot in self.kept if slot != spared), None)
        if slot is None:
            return False
        self._drop(slot)
        return True

    def drop_all(self) -> None:
        """Give back every copy."""
        for slot in list(self.kept):
            self._drop(slot)

    def _drop(self, slot) -> None:
        buffer, _ = self.kept.pop(slot)
        buffer.release()
        self.stats["dropped"] += 1


def try_acquire(pool, nbytes: int):
    """A buffer of ``pool`` now, or None where it has no room."""
    try:
        return pool.acquire(nbytes, timeout=0)
    except TimeoutError:
        return None
