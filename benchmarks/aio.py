"""zinf's swap engine vs fio vs dd: O_DIRECT reads and writes of one file size.

    python benchmarks/aio.py [--size 4GiB] [--rounds 3] [--folder DIR]
                             [--block 1MiB] [--queue-depth 8] [--threads 4]

Every tool moves the same bytes with O_DIRECT, so the page cache does not
count:
* zinf: ``AioEngine`` (``threads`` workers doing pwritev/preadv of ``block``
  pieces, ``queue_depth`` pieces per request in flight) on 256 MiB requests
  staged in two ``PinnedPool`` buffers, as the runtime uses it: all writes
  submitted at once, reads two at a time (a buffer is reused only after its
  read is verified).  The figures include the checksum on write and its
  verification on read.
* fio (libaio engine, ``block`` requests, iodepth ``queue_depth``); installed
  with apt-get if missing, skipped with a message if that fails.
* dd (``oflag=direct`` / ``iflag=direct``, ``block`` requests, one at a time).
Rounds are interleaved (each round runs every tool once, in a rotating
order) and medians are reported.  Everything written is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from zinf_compiler.runtime.aio import AioEngine, human_bytes
from zinf_compiler.runtime.pinned import PinnedPool

CHUNK = 256 << 20  # bytes per zinf request (one pinned staging buffer)
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
         "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4GiB, 512MiB)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


# --- the tools: each returns (read GB/s, write GB/s) ------------------------------------


class Zinf:
    name = "zinf AioEngine"

    def __init__(self, size: int, block: int, queue_depth: int, threads: int):
        self.size, self.block, self.queue_depth, self.threads = size, block, queue_depth, threads
        self.pool = PinnedPool(2 * CHUNK)  # made once: touching fresh memory is slow here
        self.buffers = [self.pool.acquire(CHUNK), self.pool.acquire(CHUNK)]
        pattern = os.urandom(1 << 20)
        for buffer in self.buffers:
            view = buffer.memoryview()
            for start in range(0, CHUNK, len(pattern)):
                view[start : start + len(pattern)] = pattern
            view[:8] = os.urandom(8)  # the two buffers differ

    def label(self) -> str:
        return f"zinf AioEngine ({self.threads} threads, queue depth {self.queue_depth})"

    def run(self, folder: str) -> tuple[float, float]:
        count = self.size // CHUNK
        with AioEngine(folder, block_size=self.block, queue_depth=self.queue_depth, threads=self.threads) as engine:
            if not engine.direct:
                raise SystemExit(f"refusing: {folder} does not support O_DIRECT (tmpfs?); pass --folder on a real disk")
            started = time.perf_counter()
            writes = [engine.write(f"bench.{i}", self.buffers[i % 2], CHUNK) for i in range(count)]
            for request in writes:
                request.wait()
            write_seconds = time.perf_counter() - started
            started = time.perf_counter()
            in_flight = []
            for i in range(count):
                if len(in_flight) == 2:
                    in_flight.pop(0).wait()
                in_flight.append(engine.read(f"bench.{i}", self.buffers[i % 2], CHUNK))
            for request in in_flight:
                request.wait()
            read_seconds = time.perf_counter() - started
        return self.size / read_seconds / 1e9, self.size / write_seconds / 1e9


class Fio:
    name = "fio"

    def __init__(self, size: int, block: int, queue_depth: int):
        self.size, self.block, self.queue_depth = size, block, queue_depth

    def label(self) -> str:
        return f"fio (libaio, iodepth {self.queue_depth})"

    def _job(self, path: str, mode: str) -> float:
        command = ["fio", "--name=zinf-bench", f"--filename={path}", f"--rw={mode}", f"--bs={self.block}",
                   f"--size={self.size}", "--direct=1", "--ioengine=libaio", f"--iodepth={self.queue_depth}",
                   "--numjobs=1", "--output-format=json"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed: {done.stderr.strip()[-300:]}")
        result = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0][mode]
        return result["bw_bytes"] / 1e9

    def run(self, folder: str) -> tuple[float, float]:
        path = os.path.join(folder, "fio.bench")
        try:
            write = self._job(path, "write")
            read = self._job(path, "read")
        finally:
            if os.path.exists(path):
                os.unlink(path)
        return read, write


class Dd:
    name = "dd"

    def __init__(self, size: int, block: int):
        self.size, self.block = size, block

    def label(self) -> str:
        return "dd (oflag=direct / iflag=direct)"

    def _copy(self, args: list[str]) -> float:
        command = ["dd", *args, f"bs={self.block}", f"count={self.size // self.block}"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed: {done.stderr.strip()[-300:]}")
        seconds = float(re.search(r"copied, ([0-9.e-]+) s", done.stderr).group(1))
        return self.size / seconds / 1e9

    def run(self, folder: str) -> tuple[float, float]:
        path = os.path.join(folder, "dd.bench")
        try:
            write = self._copy(["if=/dev/zero", f"of={path}", "oflag=direct"])
            read = self._copy([f"if={path}", "of=/dev/null", "iflag=direct"])
        finally:
            if os.path.exists(path):
                os.unlink(path)
        return read, write


def ensure_fio() -> str | None:
    """None when fio is available (installing it if needed), else why not."""
    if shutil.which("fio"):
        return None
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "fio"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"fio is not installed and `{shlex.join(command)}` failed: {err}"
        if done.returncode != 0:
            return f"fio is not installed and `{shlex.join(command)}` failed: {done.stderr.strip()[-200:]}"
    return None if shutil.which("fio") else "fio is not installed and apt-get did not provide it"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_size, default="4GiB", help="bytes per run and tool (default 4GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--block", type=parse_size, default="1MiB", help="request size (default 1MiB)")
    parser.add_argument("--queue-depth", type=int, default=8, help="zinf pieces per request / fio iodepth (8)")
    parser.add_argument("--threads", type=int, default=4, help="zinf worker threads (default 4)")
    parser.add_argument("--folder", default=tempfile.gettempdir(),
                        help="where to write, on the disk to measure (default: the temp folder)")
    args = parser.parse_args()
    print("command: " + shlex.join([os.path.basename(sys.executable), *sys.argv]), flush=True)
    size = args.size - args.size % CHUNK
    if size <= 0:
        print(f"refusing: --size must be at least {human_bytes(CHUNK)}")
        return 2
    free = shutil.disk_usage(args.folder).free
    if free < 2 * size:
        print(f"refusing: {args.folder} has {human_bytes(free)} free; the benchmark needs twice the size, "
              f"{human_bytes(2 * size)} (lower --size or pick another --folder)")
        return 2
    fio_problem = ensure_fio()
    if fio_problem:
        print(f"fio skipped: {fio_problem}")
    folder = tempfile.mkdtemp(prefix="zinf-aio-bench-", dir=args.folder)
    tools = []
    try:
        tools.append(Zinf(size, args.block, args.queue_depth, args.threads))
        tools.append(Dd(size, args.block))
        if not fio_problem:
            tools.append(Fio(size, args.block, args.queue_depth))
        samples = {tool.name: {"read": [], "write": []} for tool in tools}
        for round_index in range(args.rounds):
            shift = round_index % len(tools)
            for tool in tools[shift:] + tools[:shift]:
                read, write = tool.run(folder)
                samples[tool.name]["read"].append(read)
                samples[tool.name]["write"].append(write)
                print(f"round {round_index + 1}: {tool.name:<15} read {read:5.2f} GB/s   write {write:5.2f} GB/s",
                      flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    medians = {name: {mode: statistics.median(values) for mode, values in by_mode.items()}
               for name, by_mode in samples.items()}
    peers = [tool.name for tool in tools if tool.name != Zinf.name]
    best = {mode: max(peers, key=lambda name: medians[name][mode]) for mode in ("read", "write")}
    zinf = medians[Zinf.name]
    print(f"\n{human_bytes(size)} per run, {args.rounds} interleaved rounds, medians; O_DIRECT, "
          f"{human_bytes(args.block)} requests; GB = 1e9 bytes")
    print("| tool | read GB/s | write GB/s |\n|---|---|---|")
    for tool in tools:
        print(f"| {tool.label()} | {medians[tool.name]['read']:.2f} | {medians[tool.name]['write']:.2f} |")
    ratios = {mode: zinf[mode] / medians[best[mode]][mode] for mode in ("read", "write")}
    print(f"| zinf / best peer | {ratios['read']:.2f} (vs {best['read']}) | {ratios['write']:.2f} "
          f"(vs {best['write']}) |")
    met = all(ratio >= 0.9 for ratio in ratios.values())
    print(f"\ntarget zinf >= 0.90 x best peer: {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
