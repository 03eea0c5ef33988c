"""Asynchronous copies for the fetch pipeline: a worker thread on CPU, a side stream on CUDA.

``CopyEngine.copy(target, source, track, name)`` (the process's: ``Runtime.copier``) starts ``target.copy_(source)``
and returns a :class:`CopyWork`.  Both tensors must stay untouched (and alive:
the caller holds them) until the work is waited on.

* CPU: one worker thread runs the copies in submission order (PyTorch
  releases the GIL inside ``copy_``), so a copy issued ahead of its use
  overlaps the main thread's compute.  A copy with no I/O around it
  (``busy_cores_inline``: world size 1's gather of shards resting in memory)
  runs at once on the caller's thread instead when the compute already keeps
  every core busy (torch's threads times the node's ranks cover the cores):
  there a worker only takes a core from the compute and adds a hand-off to
  each wait (benchmarks/RESULTS.md, 2026-11-25: with the trim change in
  zinf_compiler/optim.py, the cpu tier's GPT step at world size 1 on 2
  cores went from 0.550 s to 0.402 s).  Copies next to NVMe reads keep the
  worker, which fills the main thread's waits on the disk.
* CUDA: the copy runs on one side stream per device, after that stream has
  waited for the current stream (``target`` was allocated there, so its
  memory is free to write only from that point).  ``wait()`` makes the
  current stream wait for the copy's event, so no host block and no
  ``record_stream``: the store keeps ``target`` and ``source`` referenced
  until ``wait()``/``synchronize()``, and the compute stream frees ``target``
  only after its own later use.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import torch

from .host_memory import ranks_on_node
from .trace import Tracer, now


# A copy with no I/O around it this small runs on the caller's thread: handing it to the worker and
# waiting for it costs ~15-20 us on the 2-core machine, more than copying 256 KiB there.
INLINE_COPY_BYTES = 256 << 10


class CopyWork:
    """A copy in flight: ``wait()`` orders later compute after it; ``synchronize()`` blocks the host."""

    def __init__(self, tracer: Tracer, future: concurrent.futures.Future | None = None, event=None,
                 tensors: tuple = (), device: torch.device | None = None):
        self._tracer = tracer  # a host wait on the copy is a stall on its timeline
        self._future = future
        self._event = event
        self._device = device  # CUDA: the device whose current stream must wait (not the process's current one)
        # CUDA: both tensors stay referenced until the current stream is ordered after the copy,
        # so the caching allocator cannot hand their memory out while the side stream uses it.
        self._tensors = tensors

    def wait(self) -> None:
        """Order later work after the copy (CUDA: the current stream waits; CPU: the host waits)."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._tensors = ()
            return
        self.synchronize()

    def synchronize(self) -> None:
        """Block the host until the copy is done; raises if it failed."""
        if self._event is not None:
            if not self._event.query():
                with self._tracer.stall("wait copy"):
                    self._event.synchronize()
            self._tensors = ()  # done: the memory it read and wrote may be reused
            return
        if self._future is not None:
            if not self._future.done():
                with self._tracer.stall("wait copy"):
                    self._future.result()
            else:
                self._future.result()  # re-raises a failed copy

    def wait_done(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for the copy; whether it finished.  Never raises (``synchronize()``
        still follows and raises a failed copy's error).  True at once on CUDA: ``wait()`` orders a stream
        there and does not block the host, so there is no host wait to fill."""
        if self._event is not None or self._future is None:
            return True
        concurrent.futures.wait([self._future], timeout=timeout)
        return self._future.done()

    def done(self) -> bool:
        """Whether the copy has finished (CUDA: then the tensors kept for it are let go)."""
        if self._event is not None:
            finished = bool(self._event.query())
            if finished:
                self._tensors = ()
            return finished
        return self._future is None or self._future.done()


class CopyEngine:
    """The process's asynchronous copies (one per process: ``Runtime.copier``), drawn on ``tracer``'s timeline."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zinf-copy")
            return self._executor

    @staticmethod
    def cores_busy() -> bool:
        """Whether the compute's threads occupy every core this process may run on: torch's intra-op
        threads, times the ranks on this node (``LOCAL_WORLD_SIZE``, set by torchrun)."""
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        return torch.get_num_threads() * ranks_on_node() >= cores

    def copy(self, target: torch.Tensor | list[torch.Tensor], source: torch.Tensor | list[torch.Tensor], track: str,
             name: str, busy_cores_inline: bool = False) -> CopyWork:
        """Start ``target.copy_(source)`` off the caller's thread or stream; ``track``/``name`` label the trace.

        ``target`` and ``source`` may be equal-length lists: one work copies each pair (on CUDA in one
        launch, ``torch._foreach_copy_``), which is what a bucket's pieces cost one call for.
        ``busy_cores_inline``: on the CPU, copy at once on this thread if the compute keeps every core busy
        or the copy is small (``INLINE_COPY_BYTES``).
        """
        targets = list(target) if isinstance(target, (list, tuple)) else [target]
        sources = list(source) if isinstance(source, (list, tuple)) else [source]
        nbytes = sum(t.numel() * t.element_size() for t in targets)
        submitted = now()
        if targets[0].is_cuda or sources[0].is_cuda:
            device = targets[0].device if targets[0].is_cuda else sources[0].device
            stream = self._streams.get(device.index)
            if stream is None:
                stream = self._streams[device.index] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                _copy_all(targets, sources, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            # Host-side interval (submission to now): a GPU timeline is in the profiler, not here.
            self.tracer.interval(track, name, submitted, now(), nbytes)
            return CopyWork(self.tracer, event=event, tensors=(targets, sources), device=device)

        if busy_cores_inline and (nbytes <= INLINE_COPY_BYTES or self.cores_busy()):
            started = now()
            _copy_all(targets, sources)
            self.tracer.interval(track, name, started, now(), nbytes)
            return CopyWork(self.tracer)

        # The worker thread has its own grad and inference modes: copy under the
        # caller's inference mode, where ``target`` may be an inference tensor.
        inference = torch.is_inference_mode_enabled()

        def run() -> None:
            started = now()
            with torch.inference_mode(inference):
                _copy_all(targets, sources)
            self.tracer.interval(track, name, started, now(), nbytes)

        return CopyWork(self.tracer, future=self._worker().submit(run))



def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor], non_blocking: bool = False) -> None:
    """Each ``targets[i].copy_(sources[i])``: one call for one pair, one foreach call for several."""
    if len(targets) == 1:
        targets[0].copy_(sources[0], non_blocking=non_blocking)
    else:
        torch._foreach_copy_(targets, sources, non_blocking=non_blocking)
