"""When to take a parameter's optimizer step during backward: at which of its gradient's arrivals.

Shared by the two early steps (runtime/optim/early_adam.py for state on NVMe, runtime/optim/early_host_adam.py for state in
host memory).  A parameter's gradient may arrive several times in one step: a parameter two graphs use, or
accumulation over micro-batches, or a tiled parameter whose tiles arrive one by one (an arrival is complete when
every tile has come).  An early step is taken at the arrival the previous step ended with (the first step guesses
one); a later arrival voids it, and the step is taken after backward as usual.  After a step that clipped, no step
is taken early: clipping tends to repeat, and a voided step costs its work twice.
"""

from __future__ import annotations


class Arrivals:
    """The gradient arrivals of one optimizer's parameters since its last step, and the count each step ended with."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}  # uid -> whole gradients added since the last step
        self.expected: dict[int, int] = {}  # uid -> whole gradients the last step had
        self.tiles: dict[int, set] = {}  # uid -> tiles added in the arrival under way
        self.skip_next = False  # the last step clipped: no early steps this time

    def arrived(self, record, tile: int | None) -> bool:
        """A gradient (or ``tile`` of it) was added to ``record``'s: whether this is the arrival to step at."""
        if tile is not None:
            seen = self.tiles.setdefault(record.uid, set())
            seen.add(tile)
            if len(seen) < len(record.tile_rows):
                return False
            del self.tiles[record.uid]
        count = self.counts[record.uid] = self.counts.get(record.uid, 0) + 1
        return not self.skip_next and count == self.expected.get(record.uid, 1)

    def dropped(self, uid: int) -> None:
        """``opt.zero_grad()``: the gradient is gone, and its arrivals with it."""
        self.counts.pop(uid, None)
        self.tiles.pop(uid, None)

    def stepped(self, clipped: bool) -> None:
        """``opt.step()`` took this step (``clipped``: clipping scaled its gradients): the next one expects the
        arrivals this one had."""
        self.expected.update(self.counts)
        self.counts = {}
        self.tiles = {}
        self.skip_next = clipped


class EarlyStep:
    """What the store tells an early step of (its ``grad_listener``, runtime/store_grads.py): a gradient's
    arrival, a gradient changed in place, gradients dropped.  Subclasses (runtime/optim/early_adam.py,
    runtime/optim/early_host_adam.py) hold ``groups_by_uid`` (uid -> the param group it steps with) and
    ``arrivals``, and say how a step starts (``start``) and is made void (``_cancel``)."""

    groups_by_uid: dict
    arrivals: Arrivals

    def arrival(self, record, tile: int | None) -> bool:
        """A gradient (or a tile of it) was added to ``record``'s: whether to step it now.  Any early step of
        ``record`` started before is void from here on."""
        self._cancel(record.uid)
        return self.arrivals.arrived(record, tile) and record.uid in self.groups_by_uid and record.owns_state

    def gradient_changed(self, record) -> None:
        """``record``'s gradient was changed in place after it arrived (scaled: ``store.scale_grads``): an
        early step taken from it is void (the optimizer step takes it late)."""
        self._cancel(record.uid)

    def gradients_dropped(self, record) -> None:
        """``opt.zero_grad()``: the gradient is gone, and so is any step taken from it."""
        self._cancel(record.uid)
        self.arrivals.dropped(record.uid)

    def _cancel(self, uid: int) -> None:
        raise NotImplementedError
