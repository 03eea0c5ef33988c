"""Work that moves on at the store's transfer points and inside its waits (the optimizer's early steps,
runtime/optim/early_adam.py): a part of :class:`~.store.ParamStore`, which makes the state it uses."""

from __future__ import annotations

from .records import BACKGROUND_POLL_SECONDS, POOL_WAIT_SECONDS
from .trace import now


class BackgroundSteps:
    """The store's background work: ``self._background`` (a WeakSet) and ``self.comm`` come from ParamStore."""

    def add_background_work(self, work) -> None:
        """``work.advance()`` (which must never wait) runs at each transfer point of every graph; held weakly."""
        self._background.add(work)

    def _advance_background(self) -> bool:
        """Move every background work on without waiting; True while any has transfers in flight."""
        in_flight = False
        for work in list(self._background):
            in_flight |= bool(work.advance())
        return in_flight

    def _wait_working(self, handle) -> None:
        """Before waiting on ``handle`` (a collective's or a world-size-1 copy's, comm.py and copy_engine.py,
        or an NVMe read's, aio_requests.py): advance the background work until ``handle`` is done or that work
        has nothing in flight; the caller's own wait follows.

        Why: a rank of a CPU device waits for gloo with its core idle, and the
        early optimizer step moves on only at transfer points: reads it had
        started landed during the wait and their Adam and writes waited for the
        next point.  Traced at world size 2, the early step's I/O was in flight
        a third of backward and 0.5 s alone in ``opt.step()``.  ``wait_done``
        returns at once where a wait does not block this thread (NCCL).  After
        ``POOL_WAIT_SECONDS`` the caller's own wait takes over, whatever is in
        flight: a transfer that never ends still meets its timeout and error.
        """
        if not self._background:
            return
        deadline = now() + POOL_WAIT_SECONDS
        while self._advance_background() and now() < deadline:
            with self.comm.tracer.stall("wait (early optimizer steps in flight)"):
                if handle.wait_done(BACKGROUND_POLL_SECONDS):
                    return
