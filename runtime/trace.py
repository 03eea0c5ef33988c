"""A timeline of one training step: compute, transfers and bytes per tier.

With ``dump_dir`` set, the backend arms the process's tracer (``Runtime.tracer``, runtime/process.py) for optimizer step
``trace_step`` (default 2: the first step pays for compilation) of the model it compiles: the steps
counted are those of optimizers over that model's parameters (other models in the process train on
without moving the count), and a model dropped before its traced step ends its recording unwritten.
Recording starts when step ``trace_step - 1`` returns from ``optimizer.step()`` (or at
the first forward, for ``trace_step=1``) and ends when step ``trace_step``
returns; then ``trace.json`` (Chrome trace, opens in Perfetto or
chrome://tracing) and ``memory.png`` (bytes per tier over time, when
matplotlib is installed) are written next to the graph dumps.

What is recorded, and by whom:

* transfer intervals, one track each: ``nc`` (NVMe reads of parameter
  shards), ``cg`` (host-to-device copies), ``gg`` (all-gathers), ``rs``
  (gradient reduce-scatters), ``offload`` (gradient and parameter writes to
  NVMe), ``optimizer io`` (the NVMe optimizer's master and moment traffic),
  ``activations`` (saved activations copied off the device, written to and
  read from NVMe, and fetched back).
  Each interval runs from the submission of the transfer to its completion
  as seen by the thread that did it (the aio worker, the copy thread, the
  collective's completion callback).
* stalls: spans in which the main (compute) thread blocks waiting for a
  transfer.  The ``compute`` track is the traced window minus the stalls:
  everything the main thread did that was not waiting.
* bytes per tier (device, cpu, pinned in use, nvme), sampled every 5 ms.

:meth:`Tracer.summary` gives step, compute, transfer (the union of all
transfer intervals) and stall seconds; ``benchmarks/overlap.py`` reports them.
Nothing here knows FX; it is called from the store, the aio engine, the copy
engine and the optimizer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import weakref
from typing import Callable, Iterable, Iterator

log = logging.getLogger("zinf")

TRANSFER_TRACKS = ("nc", "cg", "gg", "rs", "offload", "optimizer io", "activations")
TRACKS = ("compute", "stall") + TRANSFER_TRACKS
SAMPLE_SECONDS = 0.005


def now() -> float:
    """The trace's clock (seconds, monotonic)."""
    return time.perf_counter()


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _dead() -> None:
    """What a dead weak reference returns."""


class Tracer:
    """Records one step's timeline (see the module docstring); cheap when not recording."""

    def __init__(self) -> None:
        self.recording = False
        self._lock = threading.Lock()
        self._folder: str | None = None
        self._trace_step = 0
        self._steps_seen = 0
        self._main_thread: int | None = None
        self._intervals: list[tuple[str, str, float, float, int]] = []
        self._stalls: list[tuple[str, float, float]] = []
        self._samples: list[tuple[float, dict[str, int]]] = []
        self._marks: list[tuple[str, float]] = []
        self._sampler: threading.Thread | None = None
        self._sample_fn: Callable[[], dict[str, int]] | None = None
        # The parameters of the model that armed the trace, by id (weakly: the trace must not keep a dropped
        # model; not a WeakSet, whose lookups compare tensors with ==).
        self._owner: dict[int, weakref.ref] | None = None
        self._window: tuple[float, float] | None = None
        self.last_summary: dict | None = None
        self.last_files: list[str] = []

    # --- arming (backend) and step boundaries (optimizer) ------------------------------

    def arm(self, folder: str, trace_step: int, sample_fn: Callable[[], dict[str, int]] | None,
            params: Iterable = ()) -> None:
        """Trace optimizer step ``trace_step`` (counted from now) of the model with ``params`` into ``folder``.

        Every compile calls this; a pending arm for the same folder is kept
        (a graph break compiles mid-step), a recording is never interrupted
        while its model lives.  Without ``params`` every optimizer's step counts.
        """
        self._forget_a_dropped_model()
        with self._lock:
            if trace_step <= 0 or self.recording or self._folder == folder:
                return
            self._folder, self._trace_step, self._sample_fn = folder, trace_step, sample_fn
            self._owner = {id(param): weakref.ref(param) for param in params} or None
            self._steps_seen = 0
        if trace_step == 1:
            self._start()

    def step_done(self, params: Iterable = ()) -> None:
        """An optimizer over ``params`` returned from ``step()``: start or finish the recording."""
        if self._folder is None or self._forget_a_dropped_model():
            return
        if self._owner is not None and not any(self._owner.get(id(param), _dead)() is param for param in params):
            return  # another model's step
        self._steps_seen += 1
        if self.recording and self._steps_seen == self._trace_step:
            self._finish()
        elif not self.recording and self._steps_seen == self._trace_step - 1:
            self._start()

    def _forget_a_dropped_model(self) -> bool:
        """Disarm, dropping what was recorded, when every parameter of the armed model is gone."""
        if self._owner is None or any(ref() is not None for ref in self._owner.values()):
            return False
        if self.recording:
            self.recording = False
            if self._sampler is not None:
                self._sampler.join()
                self._sampler = None
            log.warning("zinf: the model traced into %s was dropped before its step %d: no trace written",
                        self._folder, self._trace_step)
        with self._lock:
            self._intervals, self._stalls, self._samples, self._marks = [], [], [], []
            self._folder, self._owner, self._sample_fn = None, None, None
        return True

    def _start(self) -> None:
        with self._lock:
            self._intervals, self._stalls, self._samples, self._marks = [], [], [], []
            self._main_thread = threading.get_ident()
            self._window = (now(), float("nan"))
            self.recording = True
        if self._sample_fn is not None:
            self._sampler = threading.Thread(target=self._sample_loop, name="zinf-trace-sampler", daemon=True)
            self._sampler.start()

    def _finish(self) -> None:
        self.recording = False
        self._window = (self._window[0], now())
        if self._sampler is not None:
            self._sampler.join()
            self._sampler = None
        self._sample()  # the final state
        self.last_summary = self.summary()
        try:
            self.last_files = self.write(self._folder)
            log.warning("zinf: traced step %d: %s", self._trace_step, ", ".join(self.last_files))
        except OSError as err:  # a trace is a diagnostic: never fail training over it
            log.warning("zinf: could not write the step trace to %s: %s", self._folder, err)
        self._folder, self._owner = None, None

    def _sample_loop(self) -> None:
        while self.recording:
            self._sample()
            time.sleep(SAMPLE_SECONDS)

    def _sample(self) -> None:
        if self._sample_fn is None:
            return
        try:
            values = self._sample_fn()
        except Exception:  # noqa: BLE001 - sampling races with the runtime; skip a sample
            return
        self._samples.append((now(), values))

    # --- recording (runtime) ---------------------------------------------------------

    def interval(self, track: str, name: str, start: float, stop: float, nbytes: int = 0) -> None:
        """Record that ``name`` ran on ``track`` from ``start`` to ``stop`` moving ``nbytes`` (while recording)."""
        if self.recording:
            self._intervals.append((track, name, start, stop, nbytes))

    @contextlib.contextmanager
    def stall(self, name: str) -> Iterator[None]:
        """The main thread blocks inside this block (on anything but its own compute)."""
        if not self.recording or threading.get_ident() != self._main_thread:
            yield
            return
        started = now()
        try:
            yield
        finally:
            self._stalls.append((name, started, now()))

    # --- results ------------------------------------------------------------------------

    def _compute_intervals(self) -> list[tuple[float, float]]:
        start, stop = self._window
        intervals, cursor = [], start
        for _, stall_start, stall_stop in sorted(self._stalls, key=lambda s: s[1]):
            if stall_start > cursor:
                intervals.append((cursor, stall_start))
            cursor = max(cursor, stall_stop)
        if stop > cursor:
            intervals.append((cursor, stop))
        return intervals

    def mark(self, name: str) -> None:
        """A named instant on the timeline (the optimizer step's start splits the summary)."""
        if self.recording:
            self._marks.append((name, now()))

    def _window_summary(self, start: float, stop: float) -> dict:
        def clip(intervals):
            return [(max(a, start), min(b, stop)) for a, b in intervals if b > start and a < stop]

        transfers = clip([(a, b) for track, _, a, b, _ in self._intervals if track in TRANSFER_TRACKS])
        stall = union_seconds(clip([(a, b) for _, a, b in self._stalls]))
        compute = (stop - start) - stall
        transfer = union_seconds(transfers)
        return {"step_seconds": stop - start, "compute_seconds": compute, "stall_seconds": stall,
                "transfer_seconds": transfer, "sum_seconds": compute + transfer, "max_seconds": max(compute, transfer)}

    def summary(self) -> dict:
        """Seconds of the traced step: wall, compute, stalls, transfers (union and per track).

        ``graphs``: the same for forward and backward alone (up to the
        optimizer step's start), the part the schedule pass orders.
        """
        start, stop = self._window
        result = self._window_summary(start, stop)
        result["track_seconds"] = {track: union_seconds([(a, b) for t, _, a, b, _ in self._intervals if t == track])
                                   for track in TRANSFER_TRACKS}
        result["track_bytes"] = {track: sum(n for t, _, _, _, n in self._intervals if t == track)
                                 for track in TRANSFER_TRACKS}
        optimizer_start = next((at for name, at in self._marks if name == "optimizer step"), None)
        if optimizer_start is not None:
            result["graphs"] = self._window_summary(start, optimizer_start)
            result["optimizer"] = self._window_summary(optimizer_start, stop)
        return result

    def chrome_events(self) -> list[dict]:
        """The recorded step as Chrome trace events (times in microseconds from the window's start)."""
        origin = self._window[0]
        micros = lambda seconds: round((seconds - origin) * 1e6, 3)  # noqa: E731
        events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "zinf step"}}]
        for tid, track in enumerate(TRACKS):
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": track}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
        tid_of = {track: tid for tid, track in enumerate(TRACKS)}
        for start, stop in self._compute_intervals():
            events.append({"ph": "X", "name": "compute", "cat": "compute", "pid": 0, "tid": tid_of["compute"],
                           "ts": micros(start), "dur": round((stop - start) * 1e6, 3)})
        for name, start, stop in self._stalls:
            events.append({"ph": "X", "name": name, "cat": "stall", "pid": 0, "tid": tid_of["stall"],
                           "ts": micros(start), "dur": round((stop - start) * 1e6, 3)})
        for track, name, start, stop, nbytes in self._intervals:
            events.append({"ph": "X", "name": name, "cat": track, "pid": 0, "tid": tid_of[track],
                           "ts": micros(start), "dur": round(max(stop - start, 0.0) * 1e6, 3),
                           "args": {"bytes": nbytes}})
        for name, at in self._marks:
            events.append({"ph": "i", "name": name, "pid": 0, "tid": tid_of["compute"], "ts": micros(at), "s": "p"})
        for at, values in self._samples:
            events.append({"ph": "C", "name": "bytes per tier", "pid": 0, "ts": micros(at), "args": dict(values)})
        return events

    def write(self, folder: str) -> list[str]:
        """Write ``trace.json`` (and ``memory.png`` if matplotlib is there); returns the paths."""
        os.makedirs(folder, exist_ok=True)
        trace_path = os.path.join(folder, "trace.json")
        with open(trace_path, "w") as handle:
            json.dump({"traceEvents": self.chrome_events(), "displayTimeUnit": "ms",
                       "otherData": {"summary": self.last_summary or self.summary()}}, handle)
        written = [trace_path]
        png = self._plot(os.path.join(folder, "memory.png"))
        if png:
            written.append(png)
        return written

    def _plot(self, path: str) -> str | None:
        if not self._samples:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning("zinf: matplotlib is not installed: no %s (pip install matplotlib)", path)
            return None
        origin = self._window[0]
        times = [(at - origin) * 1000 for at, _ in self._samples]
        figure, (memory_axes, track_axes) = plt.subplots(2, 1, figsize=(10, 6), sharex=True,
                                                         gridspec_kw={"height_ratios": [2, 1]})
        for tier in self._samples[-1][1]:
            memory_axes.plot(times, [values.get(tier, 0) / 2**20 for _, values in self._samples], label=tier)
        memory_axes.set_ylabel("MiB")
        memory_axes.set_title("zinf: bytes per tier over one step")
        memory_axes.legend(loc="upper right")
        rows = ("compute",) + TRANSFER_TRACKS
        spans = {"compute": self._compute_intervals()}
        for track in TRANSFER_TRACKS:
            spans[track] = [(a, b) for t, _, a, b, _ in self._intervals if t == track]
        for row, track in enumerate(rows):
            track_axes.broken_barh([((a - origin) * 1000, (b - a) * 1000) for a, b in spans[track]], (row - 0.4, 0.8))
        track_axes.set_yticks(range(len(rows)), rows)
        track_axes.set_xlabel("ms")
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return path

