"""zinf's swap engine vs fio vs dd, O_DIRECT reads and writes of one file size.

    python benchmarks/aio.py [--size 4GiB --rounds 3 --folder /path/on/the/disk]

Every tool moves the same number of bytes with O_DIRECT (the page cache does
not count): zinf's AioEngine (thread pool of pwritev/preadv, 1 MiB requests,
8 in flight per thread-pool queue), fio (libaio engine, 1 MiB blocks, iodepth
8; installed with apt-get if missing, else skipped with a message) and dd
(oflag=direct / iflag=direct, 1 MiB blocks, one request at a time). Runs are
interleaved (each round runs every tool once) and medians reported. zinf's
figure includes its checksum on write and its verification on read.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from zinf_compiler.options import parse_bytes
from zinf_compiler.runtime.aio import AioEngine, human_bytes
from zinf_compiler.runtime.pinned import PinnedPool


def _zinf(folder: str, size: int, block: int, threads: int) -> tuple[float, float]:
    chunk = 256 << 20  # one pinned staging buffer per request, as the runtime uses them
    pool = PinnedPool(2 * chunk)
    engine = AioEngine(folder, block_size=block, threads=threads)
    try:
        buffers = [pool.acquire(chunk), pool.acquire(chunk)]
        for buffer in buffers:
            view = buffer.memoryview()
            view[:] = os.urandom(1 << 20) * (chunk >> 20)
        count = size // chunk
        started = time.perf_counter()
        requests = [engine.write(f"bench.{i}", buffers[i % 2], chunk) for i in range(count)]
        for request in requests:
            request.wait()
        write_seconds = time.perf_counter() - started
        started = time.perf_counter()
        pending = []
        for i in range(count):  # two reads in flight, alternating buffers
            pending.append(engine.read(f"bench.{i}", buffers[i % 2], chunk))
            if len(pending) == 2:
                pending.pop(0).wait()
        for request in pending:
            request.wait()
        read_seconds = time.perf_counter() - started
        return size / read_seconds / 1e9, size / write_seconds / 1e9
    finally:
        engine.close()


def _fio(folder: str, size: int, block: int) -> tuple[float, float]:
    path = os.path.join(folder, "fio.bench")
    results = []
    try:
        for mode in ("read", "write") if os.path.exists(path) else ("write", "read"):
            done = subprocess.run(
                ["fio", "--name=zinf", f"--filename={path}", f"--rw={mode}", f"--bs={block}", f"--size={size}",
                 "--direct=1", "--ioengine=libaio", "--iodepth=8", "--numjobs=1", "--group_reporting",
                 "--output-format=terse", "--terse-version=3"],
                capture_output=True, text=True, check=True)
            fields = done.stdout.strip().splitlines()[-1].split(";")
            read_kib, write_kib = float(fields[6]), float(fields[47])  # bandwidth in KiB/s
            results.append((mode, (read_kib if mode == "read" else write_kib) * 1024 / 1e9))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    by_mode = dict(results)
    return by_mode["read"], by_mode["write"]


def _dd(folder: str, size: int, block: int) -> tuple[float, float]:
    path = os.path.join(folder, "dd.bench")
    count = size // block
    try:
        def run(args: list[str]) -> float:
            done = subprocess.run(["dd", *args, f"bs={block}", f"count={count}"], capture_output=True, text=True,
                                  check=True)
            seconds = float(re.search(r"copied, ([0-9.]+) s", done.stderr).group(1))
            return size / seconds / 1e9

        write = run(["if=/dev/zero", f"of={path}", "oflag=direct"])
        read = run([f"if={path}", "of=/dev/null", "iflag=direct"])
        return read, write
    finally:
        if os.path.exists(path):
            os.unlink(path)


def _ensure_fio() -> str | None:
    if shutil.which("fio"):
        return None
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "fio"]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return f"fio is not installed and `{' '.join(command)}` failed: {done.stderr.strip()[-200:]}"
    return None if shutil.which("fio") else "fio did not install"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block", default="1MiB")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--folder", default=None, help="where to write (default: a temp folder under the repo)")
    args = parser.parse_args()
    size, block = parse_bytes(args.size), parse_bytes(args.block)
    size -= size % (256 << 20)
    print("command: python " + " ".join(sys.argv))
    parent = args.folder or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    free = shutil.disk_usage(parent).free
    if free < 2 * size:
        print(f"refusing: {parent} has {human_bytes(free)} free, the benchmark needs {human_bytes(2 * size)}")
        return 2
    fio_problem = _ensure_fio()
    if fio_problem:
        print(f"fio skipped: {fio_problem}")
    tools = {"zinf AioEngine": lambda f: _zinf(f, size, block, args.threads), "dd": lambda f: _dd(f, size, block)}
    if not fio_problem:
        tools["fio (libaio, iodepth 8)"] = lambda f: _fio(f, size, block)
    samples = {name: {"read": [], "write": []} for name in tools}
    folder = tempfile.mkdtemp(prefix="zinf-aio-bench-", dir=parent)
    try:
        for round_index in range(args.rounds):
            for name, run in tools.items():
                read, write = run(folder)
                samples[name]["read"].append(read)
                samples[name]["write"].append(write)
                print(f"round {round_index + 1}: {name:<24} read {read:.2f} GB/s  write {write:.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    medians = {name: {mode: statistics.median(values) for mode, values in by_mode.items()}
               for name, by_mode in samples.items()}
    peers = [name for name in medians if not name.startswith("zinf")]
    best = {mode: max(medians[name][mode] for name in peers) for mode in ("read", "write")}
    print(f"\n{human_bytes(size)} per run, {args.rounds} interleaved rounds, medians, O_DIRECT, {human_bytes(block)} blocks")
    print("| tool | read GB/s | write GB/s |\n|---|---|---|")
    for name, median in medians.items():
        print(f"| {name} | {median['read']:.2f} | {median['write']:.2f} |")
    zinf_name = "zinf AioEngine"
    print(f"\nzinf / best peer: read {medians[zinf_name]['read'] / best['read']:.2f}, "
          f"write {medians[zinf_name]['write'] / best['write']:.2f} (target >= 0.90)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
