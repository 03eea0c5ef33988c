"""The swap engine (runtime/aio.py): O_DIRECT swap files, async requests, checksums, failure handling."""

import contextlib
import errno
import os
import pathlib
import signal
import stat
import tempfile

import pytest
import torch

from zinf_compiler.runtime import aio as aio_module, aio_requests
from zinf_compiler.runtime.aio import AioChecksumError, AioEngine, AioError, validate_folder
from zinf_compiler.runtime.pinned import PinnedPool


@pytest.fixture
def engine(tmp_path):
    engine = AioEngine(str(tmp_path), block_size=64 * 1024, queue_depth=3, threads=3)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def pool():
    return PinnedPool(16 << 20)


def _random_buffer(pool, numel, seed, dtype=torch.float32):
    buffer = pool.acquire(numel * dtype.itemsize)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)
    buffer.tensor(dtype, numel).copy_(values)
    return buffer, values


def test_round_trip_odd_sizes_many_requests_in_flight(engine, pool):
    # Sizes that are not multiples of 4096, some spanning many 64 KiB pieces.
    cases = [(1, torch.float32), (1000, torch.bfloat16), (4097, torch.float32), (70_001, torch.float16),
             (300_001, torch.float32), (3, torch.int64), (123_457, torch.float32)]
    buffers = [_random_buffer(pool, numel, seed, dtype) for seed, (numel, dtype) in enumerate(cases)]
    writes = [engine.write(f"param.{i}", buffer, numel * dtype.itemsize)
              for i, ((numel, dtype), (buffer, _)) in enumerate(zip(cases, buffers))]
    for request in writes:
        request.wait()
        assert request.done()
    for buffer, _ in buffers:
        buffer.memoryview()[:] = bytes(buffer.nbytes)
    reads = [engine.read(f"param.{i}", buffer, numel * dtype.itemsize)
             for i, ((numel, dtype), (buffer, _)) in enumerate(zip(cases, buffers))]
    for request in reversed(reads):
        request.wait()
    for (numel, dtype), (buffer, values) in zip(cases, buffers):
        assert torch.equal(buffer.tensor(dtype, numel), values)
        buffer.release()
    total = sum(numel * dtype.itemsize for numel, dtype in cases)
    assert engine.bytes_written == engine.bytes_read == total
    assert engine.busy_seconds > 0 and engine.backend == "threads"


def test_rewrites_alternate_slots_and_reads_see_the_newest(engine, pool):
    values = []
    with pool.acquire(100_000) as buffer:
        for seed in range(4):
            data = torch.randn(25_000, generator=torch.Generator().manual_seed(seed))
            buffer.tensor(torch.float32, 25_000).copy_(data)
            engine.write("state", buffer, 100_000).wait()
            values.append(data)
        buffer.memoryview()[:] = bytes(buffer.nbytes)
        engine.read("state", buffer).wait()  # nbytes defaults to the size written
        assert torch.equal(buffer.tensor(torch.float32, 25_000), values[-1])
        # A smaller write reuses the key's slots; a larger one grows the file.
        engine.write("state", buffer, 10).wait()
        with pytest.raises(AioError, match="asked for 100,000 bytes, 10 were written"):
            engine.read("state", buffer, 100_000)
        with pool.acquire(300_000) as big:
            engine.write("state", big, 300_000).wait()
            engine.read("state", big, 300_000).wait()


def test_plain_memoryviews_and_buffer_checks(tmp_path):
    import mmap

    with AioEngine(str(tmp_path)) as engine:
        region = mmap.mmap(-1, 3 * 4096)  # page aligned
        region[:5] = b"hello"
        engine.write("raw", memoryview(region), 5).wait()
        region[:5] = b"xxxxx"
        engine.read("raw", memoryview(region)).wait()
        assert region[:5] == b"hello"
        with pytest.raises(ValueError, match="padded to 8,192"):
            engine.write("raw", memoryview(region)[:4100], 4097)
        if engine.direct:
            with pytest.raises(ValueError, match="aligned"):
                engine.write("raw", memoryview(region)[1:4097], 4096)
        with pytest.raises(AioError, match="no write of this key"):
            engine.read("never", memoryview(region), 5)


def test_private_folder_file_modes_and_removal_at_close(tmp_path, pool):
    engine = AioEngine(str(tmp_path))
    assert os.path.dirname(engine.folder) == str(tmp_path)
    assert os.path.basename(engine.folder).startswith(f"zinf-swap-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(engine.folder).st_mode) == 0o700
    with pool.acquire(400) as buffer:
        engine.write("a/b", buffer, 400).wait()
    path = engine.path("a/b")
    assert os.path.dirname(path) == engine.folder and path != engine.path("a__b")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert engine.bytes_on_disk() >= 4096
    engine.close()
    assert not os.path.exists(engine.folder) and os.listdir(tmp_path) == []
    engine.close()  # idempotent
    with pytest.raises(AioError, match="closed"):
        engine.write("a/b", bytearray(4096), 1)


def test_folder_removed_when_the_engine_is_garbage_collected(tmp_path):
    import gc

    engine = AioEngine(str(tmp_path))
    folder = engine.folder
    del engine
    gc.collect()
    assert not os.path.exists(folder)


def _open_flags(path: str) -> int:
    """The open flags of this process's descriptor of ``path``, as the kernel holds them (/proc/self/fdinfo)."""
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # descriptors closed while listing
            if os.readlink(f"/proc/self/fd/{fd}") == path:
                with open(f"/proc/self/fdinfo/{fd}") as info:
                    line = next(line for line in info if line.startswith("flags:"))
                return int(line.split()[1], 8)
    raise AssertionError(f"no open descriptor of {path}")


def _kernel_does_direct_io(folder) -> bool:
    """Whether the kernel does real direct I/O in ``folder``: it takes an aligned O_DIRECT write and refuses an
    unaligned one (EINVAL). Asked here, not through the engine's probe, so the test does not check the probe
    against itself. tmpfs since Linux 6.6 accepts O_DIRECT but buffers it, unaligned writes included."""
    import mmap

    path = os.path.join(folder, "kernel-direct-io-check")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    block = mmap.mmap(-1, 4096)
    try:
        os.pwrite(fd, block, 0)
        try:
            os.pwrite(fd, b"unaligned", 1)
        except OSError as err:
            return err.errno == errno.EINVAL
        return False
    finally:
        block.close()
        os.close(fd)
        os.unlink(path)


def test_o_direct_is_used_on_a_real_disk(tmp_path, pool):
    # The swap files' descriptors are what bypasses the page cache: each must be open with O_DIRECT, as the
    # kernel reports it, on a disk where the kernel does direct I/O (tmp_path: ext4 on the machines this runs on).
    if not _kernel_does_direct_io(tmp_path):
        pytest.skip(f"{tmp_path} is not on a filesystem that does direct I/O (the test needs a real disk)")
    with AioEngine(str(tmp_path)) as engine, pool.acquire(3 * 4096) as buffer:
        assert engine.direct
        engine.write("param.w", buffer, 10_000).wait()
        engine.read("param.w", buffer, 10_000).wait()
        assert _open_flags(engine.path("param.w")) & os.O_DIRECT
        # Direct on this disk means the kernel refuses unaligned memory; the engine says so before issuing it.
        with pytest.raises(ValueError, match="aligned"):
            engine.write("param.w", buffer.memoryview()[1:], 4096)


def test_a_filesystem_refusing_o_direct_gets_buffered_io_dropped_from_the_page_cache(tmp_path, pool, monkeypatch):
    # tmpfs before Linux 6.6 refuses an O_DIRECT open with EINVAL (since 6.6 it accepts one and buffers it):
    # made so here for tmp_path's files, whatever this machine's kernel and disk.
    real_open, dropped = os.open, []

    def open_refusing_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT and str(path).startswith(str(tmp_path)):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    real_fadvise = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        dropped.append((offset, length, advice))
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(aio_module.os, "open", open_refusing_direct)
    monkeypatch.setattr(aio_module.os, "posix_fadvise", fadvise)
    with AioEngine(str(tmp_path), block_size=4096) as engine, pool.acquire(2 * 4096) as buffer:
        assert not engine.direct and "direct=False" in repr(engine)
        buffer.memoryview()[:5000] = bytes(range(256)) * 19 + bytes(136)
        engine.write("param.w", buffer, 5000).wait()
        assert not _open_flags(engine.path("param.w")) & os.O_DIRECT
        # Each of the two pieces written is dropped from the page cache, as O_DIRECT would have kept it out.
        assert [advice for *_, advice in dropped] == [os.POSIX_FADV_DONTNEED] * 2
        # Buffered I/O takes memory at any address, which O_DIRECT would not.
        unaligned = bytearray(3 * 4096)
        engine.read("param.w", memoryview(unaligned)[1:], 5000).wait()
        assert unaligned[1:5001] == bytes(buffer.memoryview()[:5000])


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_on_tmpfs_the_engine_says_what_its_descriptors_do(pool):
    # tmpfs: O_DIRECT refused before Linux 6.6 (buffered I/O), accepted since; either way engine.direct must say
    # which, and the swap files must be opened that way.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder, AioEngine(folder) as engine:
        with pool.acquire(4096) as buffer:
            engine.write("param.w", buffer, 4096).wait()
        flags = _open_flags(engine.path("param.w"))
        assert bool(flags & os.O_DIRECT) == engine.direct
        try:
            os.close(os.open(os.path.join(folder, "direct"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
            kernel_takes_direct = True
        except OSError as err:
            assert err.errno == errno.EINVAL
            kernel_takes_direct = False
        assert engine.direct == kernel_takes_direct


def test_validate_folder_missing_and_not_a_folder(tmp_path):
    with pytest.raises(AioError, match=r"nvme_path .*missing' does not exist; create it first \(mkdir -p"):
        validate_folder(str(tmp_path / "missing"), 1)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(AioError, match="nvme_path .* is not a folder"):
        validate_folder(str(a_file), 1)
    with pytest.raises(AioError, match="needs the option nvme_path"):
        validate_folder(None, 1)
    validate_folder(str(tmp_path), 1)  # fine


def test_validate_folder_not_writable_simulated(tmp_path, monkeypatch):
    monkeypatch.setattr(aio_module.os, "access", lambda path, mode: False)
    with pytest.raises(AioError, match="nvme_path .* is not writable"):
        validate_folder(str(tmp_path), 1)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0500 folder anyway; covered by the simulated case")
def test_validate_folder_not_writable_for_real(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(AioError, match="not writable"):
        validate_folder(str(locked), 1)


def test_validate_folder_too_small_disk(tmp_path, monkeypatch):
    real_statvfs = os.statvfs

    def small_disk(path):  # 3.2 GiB free in 4 KiB blocks
        fields = list(real_statvfs(path))
        fields[0] = fields[1] = 4096  # f_bsize, f_frsize
        fields[4] = int(3.2 * 2**30) // 4096  # f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(aio_module.os, "statvfs", small_disk)
    with pytest.raises(AioError, match=r"nvme_path .* needs 12\.0 GiB \(12,884,901,888 bytes\), 3\.2 GiB free"):
        validate_folder(str(tmp_path), 12 << 30)
    validate_folder(str(tmp_path), 3 << 30)


def test_enospc_mid_write_keeps_the_previous_good_copy(engine, pool, monkeypatch):
    good, good_values = _random_buffer(pool, 50_000, 1)
    engine.write("state", good, 200_000).wait()  # 4 pieces of 64 KiB
    calls = []
    real_pwritev = os.pwritev

    def disk_fills_up(fd, buffers, offset):
        calls.append(offset)
        if len(calls) >= 2:  # the first piece lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(aio_module.os, "pwritev", disk_fills_up)
    newer, _ = _random_buffer(pool, 50_000, 2)
    request = engine.write("state", newer, 200_000)
    with pytest.raises(AioError) as err:
        request.wait()
    message = str(err.value)
    assert "'state'" in message and engine.path("state") in message
    assert "no space left on device (ENOSPC)" in message and "disk under nvme_path" in message
    assert "is full" in message and "200,704 bytes" in message
    assert "last good copy of 'state' is kept" in message
    with pytest.raises(AioError):  # wait() keeps reporting the failure
        request.wait()
    monkeypatch.undo()
    newer.memoryview()[:] = bytes(newer.nbytes)
    engine.read("state", newer, 200_000).wait()
    assert torch.equal(newer.tensor(torch.float32, 50_000), good_values)
    assert engine.bytes_written == 200_000
    good.release()
    newer.release()


def test_other_os_errors_name_key_file_and_errno(engine, pool, monkeypatch):
    with pool.acquire(8192) as buffer:
        engine.write("k", buffer, 8192).wait()

        def broken(fd, buffers, offset):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(aio_module.os, "preadv", broken)
        with pytest.raises(AioError, match=r"NVMe swap read of 'k' .* from .*k\.swap at file offset 0 failed: EIO"):
            engine.read("k", buffer, 8192).wait()


def test_failed_first_write_leaves_nothing_readable(engine, pool, monkeypatch):
    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aio_module.os, "pwritev", full)
    with pool.acquire(4096) as buffer:
        with pytest.raises(AioError, match="is full"):
            engine.write("fresh", buffer, 4096).wait()
        monkeypatch.undo()
        with pytest.raises(AioError, match="no write of this key has completed"):
            engine.read("fresh", buffer, 4096)


def test_transaction_commits_all_or_nothing(engine, pool, monkeypatch):
    first, first_values = _random_buffer(pool, 1000, 1)
    second, second_values = _random_buffer(pool, 1000, 2)
    engine.write("x", first, 4000).wait()
    engine.write("y", first, 4000).wait()
    # An exception in the block: nothing is committed.
    with pytest.raises(RuntimeError, match="boom"):
        with engine.transaction():
            engine.write("x", second, 4000).wait()
            engine.read("x", first, 4000).wait()  # inside, reads see the block's own writes
            assert torch.equal(first.tensor(torch.float32, 1000), second_values)
            raise RuntimeError("boom")
    engine.read("x", first, 4000).wait()
    assert torch.equal(first.tensor(torch.float32, 1000), first_values)
    # A failed write whose error the block swallowed: still nothing is committed.
    disk = {"full": False}
    real_pwritev = os.pwritev

    def pwritev(fd, buffers, offset):
        if disk["full"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(aio_module.os, "pwritev", pwritev)
    with pytest.raises(AioError, match="transaction not committed.*is full"):
        with engine.transaction():
            engine.write("x", second, 4000).wait()
            disk["full"] = True
            with pytest.raises(AioError):
                engine.write("y", second, 4000).wait()
    monkeypatch.undo()
    for key in ("x", "y"):
        engine.read(key, first, 4000).wait()
        assert torch.equal(first.tensor(torch.float32, 1000), first_values), key
    # A clean block commits every write, also ones left un-waited.
    with engine.transaction():
        engine.write("x", second, 4000)
        engine.write("y", second, 4000)
    for key in ("x", "y"):
        engine.read(key, first, 4000).wait()
        assert torch.equal(first.tensor(torch.float32, 1000), second_values), key
    first.release()
    second.release()


def test_corrupted_swap_file_raises_checksum_error(engine, pool):
    buffer, _ = _random_buffer(pool, 100_000, 3)
    engine.write("w", buffer, 400_000).wait()
    with open(engine.path("w"), "r+b") as handle:  # flip one byte in the third 64 KiB piece
        handle.seek(150_001)
        byte = handle.read(1)
        handle.seek(150_001)
        handle.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(AioChecksumError, match=r"swap file .*w\.swap for 'w' is corrupt: bytes 131,072-196,607"):
        engine.read("w", buffer, 400_000).wait()
    buffer.release()


def test_checksum_notices_sectors_swapped_within_a_piece():
    import numpy as np

    data = np.random.default_rng(0).integers(0, 2**63, size=2 * 512, dtype=np.uint64)
    swapped = np.concatenate([data[512:], data[:512]])
    assert aio_requests.sector_digest(memoryview(data), 0) != aio_requests.sector_digest(memoryview(swapped), 0)


def test_folder_removed_at_interpreter_exit_but_not_by_a_forked_child(tmp_path):
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, sys
        from zinf_compiler.runtime.aio import AioEngine
        engine = AioEngine({str(tmp_path)!r})
        engine.write("k", bytearray(4096) if not engine.direct else __import__("mmap").mmap(-1, 4096), 10).wait()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # runs the child's atexit hooks
        os.waitpid(pid, 0)
        print(engine.folder, os.path.isdir(engine.folder), flush=True)
        # no close(): the interpreter exit removes the folder
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    folder, still_there = done.stdout.split()
    assert still_there == "True"  # the child left its parent's files alone
    assert not os.path.exists(folder)


def test_a_small_read_is_not_queued_behind_all_pieces_of_a_big_write(tmp_path, pool, monkeypatch):
    calls = []
    real_pwritev, real_preadv = os.pwritev, os.preadv

    def pwritev(fd, buffers, offset):
        calls.append("write")
        return real_pwritev(fd, buffers, offset)

    def preadv(fd, buffers, offset):
        calls.append("read")
        return real_preadv(fd, buffers, offset)

    with AioEngine(str(tmp_path), block_size=4096, queue_depth=2, threads=1) as engine:
        with pool.acquire(4096) as small, pool.acquire(64 * 4096) as big:
            engine.write("small", small, 4096).wait()
            monkeypatch.setattr(aio_module.os, "pwritev", pwritev)
            monkeypatch.setattr(aio_module.os, "preadv", preadv)
            write = engine.write("big", big, 64 * 4096)  # 64 pieces, at most 2 queued at a time
            read = engine.read("small", small, 4096)
            read.wait()
            write.wait()
    assert calls.count("write") == 64
    assert calls.index("read") <= 3, calls[:8]


def test_one_copy_mode_halves_the_disk_and_never_serves_a_half_written_key(tmp_path, pool, monkeypatch):
    single = AioEngine(str(tmp_path), block_size=64 << 10, copies=1)
    try:
        first, _ = _random_buffer(pool, 50_000, 1)
        second, second_values = _random_buffer(pool, 50_000, 2)
        single.write("state", first, 200_000).wait()
        single.write("state", second, 200_000).wait()
        # One slot: the rewrite went in place, the file did not grow.
        assert os.path.getsize(single.path("state")) == 200_704
        out, _ = _random_buffer(pool, 50_000, 3)
        single.read("state", out, 200_000).wait()
        assert torch.equal(out.tensor(torch.float32, 50_000), second_values)

        real_pwritev = os.pwritev
        calls = []

        def disk_fills_up(fd, buffers, offset):
            calls.append(offset)
            if len(calls) >= 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_pwritev(fd, buffers, offset)

        monkeypatch.setattr(aio_module.os, "pwritev", disk_fills_up)
        with pytest.raises(AioError, match="had one copy \\(nvme_copies=1\\) and it is lost"):
            single.write("state", first, 200_000).wait()
        monkeypatch.undo()
        with pytest.raises(AioError, match="no good copy"):
            single.read("state", out, 200_000).wait()
        # A later complete write makes the key good again.
        single.write("state", second, 200_000).wait()
        single.read("state", out, 200_000).wait()
        assert torch.equal(out.tensor(torch.float32, 50_000), second_values)
    finally:
        single.close()


# --- issue 12 item 7: a disk that fills up, messages true for nvme_copies=1, stale folders ---------------


def test_a_disk_filling_up_mid_piece_is_reported_as_enospc_not_a_short_write(engine, pool, monkeypatch):
    # What a filling disk does: it takes the first part of a write and refuses the next call.
    real_pwritev = os.pwritev
    calls = []

    def fills_up_mid_piece(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 1:
            return real_pwritev(fd, [buffers[0][: 2 * 4096]], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aio_module.os, "pwritev", fills_up_mid_piece)
    buffer, _ = _random_buffer(pool, 16_384, 1)
    with pytest.raises(AioError) as err:
        engine.write("full", buffer, 65_536).wait()
    message = str(err.value)
    assert "short write" not in message and "EIO" not in message
    assert "no space left on device (ENOSPC)" in message and str(engine.root) in message
    assert "65,536 bytes" in message and "free space there or point nvme_path" in message.lower()
    assert calls == [0, 2 * 4096]  # the rest of the piece was retried where the first part ended

    # No error from the kernel, only no progress, and no free space: still ENOSPC.
    monkeypatch.setattr(aio_module.os, "pwritev", lambda fd, buffers, offset: 0)
    full = os.statvfs_result((4096, 4096, 10, 0, 0, 10, 0, 0, 0, 255))
    monkeypatch.setattr(aio_module.os, "statvfs", lambda path: full)
    with pytest.raises(AioError, match=r"no space left on device \(ENOSPC\)"):
        engine.write("full", buffer, 65_536).wait()
    buffer.release()


def test_short_writes_that_then_succeed_write_every_byte(engine, pool, monkeypatch):
    real_pwritev = os.pwritev

    def stingy(fd, buffers, offset):
        # Writes at most two sectors and, when that is not all, claims 100 bytes less (an unaligned
        # count): the retry must start at an aligned offset (O_DIRECT) and cover the rest.
        written = real_pwritev(fd, [buffers[0][: 2 * 4096]], offset)
        return written - 100 if written < len(buffers[0]) else written

    buffer, values = _random_buffer(pool, 50_000, 4)
    monkeypatch.setattr(aio_module.os, "pwritev", stingy)
    engine.write("stingy", buffer, 200_000).wait()
    monkeypatch.undo()
    out, _ = _random_buffer(pool, 50_000, 5)
    engine.read("stingy", out, 200_000).wait()  # the checksums match: every byte landed
    assert torch.equal(out.tensor(torch.float32, 50_000), values)
    buffer.release()
    out.release()


def _enospc_after(monkeypatch, good_calls):
    real_pwritev = os.pwritev
    calls = []

    def disk_fills_up(fd, buffers, offset):
        calls.append(offset)
        if len(calls) > good_calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(aio_module.os, "pwritev", disk_fills_up)


@pytest.mark.parametrize("copies", [1, 2])
def test_failure_messages_are_true_for_the_number_of_copies(tmp_path, pool, monkeypatch, copies):
    engine = AioEngine(str(tmp_path), block_size=64 << 10, copies=copies)
    try:
        buffer, _ = _random_buffer(pool, 50_000, 1)
        # A first write: nothing older exists, nothing is lost, whatever the copies.
        _enospc_after(monkeypatch, 0)
        with pytest.raises(AioError) as err:
            engine.write("fresh", buffer, 200_000).wait()
        monkeypatch.undo()
        assert "had no earlier copy" in str(err.value) and "last good copy" not in str(err.value)
        assert "two copies" not in str(err.value)

        engine.write("x", buffer, 200_000).wait()
        engine.write("y", buffer, 200_000).wait()
        # A rewrite that fails: copies=2 keeps the last good copy, copies=1 loses its only one.
        _enospc_after(monkeypatch, 1)
        with pytest.raises(AioError) as err:
            engine.write("x", buffer, 200_000).wait()
        monkeypatch.undo()
        if copies == 2:
            assert "last good copy of 'x' is kept (nvme_copies=2" in str(err.value)
            engine.read("x", buffer, 200_000).wait()
        else:
            assert "had one copy (nvme_copies=1) and it is lost" in str(err.value)
            assert "kept" not in str(err.value) and "two copies" not in str(err.value)
            with pytest.raises(AioError, match=r"'x' .*no good copy: its only copy was being overwritten in place "
                                               r"\(nvme_copies=1\).*unusable"):
                engine.read("x", buffer, 200_000)

        # A transaction that fails: its summary says what was kept or lost.
        with pytest.raises(AioError) as err:
            with engine.transaction():
                engine.write("y", buffer, 200_000).wait()
                _enospc_after(monkeypatch, 0)
                with pytest.raises(AioError):
                    engine.write("fresh", buffer, 200_000).wait()
        monkeypatch.undo()
        message = str(err.value)
        if copies == 2:
            assert "every key keeps its copy from before it (nvme_copies=2" in message
            engine.read("y", buffer, 200_000).wait()
        else:
            assert "keeps" not in message.split(":")[0]
            assert "1 key(s) it overwrote in place lost their only copy (nvme_copies=1): 'y'" in message
            assert "unusable" in message
            with pytest.raises(AioError, match="no good copy"):
                engine.read("y", buffer, 200_000)
        buffer.release()
    finally:
        engine.close()


def test_invalidate_makes_a_key_unreadable_until_it_is_written_again(engine, pool):
    buffer, values = _random_buffer(pool, 1000, 1)
    engine.write("param.0", buffer, 4000).wait()
    engine.invalidate("param.0", "out of date: call opt.step() again")
    with pytest.raises(AioError, match=r"'param.0' .*no good copy: out of date: call opt.step\(\) again"):
        engine.read("param.0", buffer, 4000)
    engine.write("param.0", buffer, 4000).wait()
    engine.read("param.0", buffer, 4000).wait()
    assert torch.equal(buffer.tensor(torch.float32, 1000), values)
    buffer.release()


def _dead_pid():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_swap_folders_of_dead_processes_are_removed_and_live_ones_kept(tmp_path, caplog):
    import subprocess
    import sys
    import textwrap
    import time

    # A live run, with an engine of its own: never touched.
    live = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from zinf_compiler.runtime.aio import AioEngine
        engine = AioEngine({str(tmp_path)!r})
        print(engine.folder, flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        live_folder = live.stdout.readline().strip()
        # A run killed with SIGKILL: its folder (named by the engine itself) stays behind.
        script = textwrap.dedent(f"""
            import os, signal
            from zinf_compiler.runtime.aio import AioEngine
            engine = AioEngine({str(tmp_path)!r})
            engine.write("k", bytearray(4096) if not engine.direct else __import__("mmap").mmap(-1, 4096), 10).wait()
            print(engine.folder, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        killed_folder = done.stdout.strip()
        assert done.returncode == -9 and os.path.isdir(killed_folder), done.stderr

        assert os.path.isdir(live_folder)
        live_name = os.path.basename(live_folder)
        pid, owner = live_name.split("-")[2:4]
        start, namespace, boot, host = owner.split(".")
        assert int(pid) == live.pid

        def fake(name, age=0.0):
            path = tmp_path / name
            path.mkdir()
            (path / "param.0.swap").write_bytes(b"x" * 8192)
            if age:
                os.utime(path, (time.time() - age, time.time() - age))
            return path

        dead = _dead_pid()
        stale = [
            fake(f"zinf-swap-{dead}-abcd1234"),  # made by an older zinf, its pid is gone
            fake(f"zinf-swap-{dead}-{int(start) + 7}.{namespace}.{boot}.{host}-abcd1234"),  # pid gone
            # The live child's pid, but a different start time: the folder's owner died and the pid was reused.
            fake(f"zinf-swap-{live.pid}-{int(start) - 1}.{namespace}.{boot}.{host}-abcd1234"),
            # Older zinf: the live child's pid, but the folder last changed an hour before the child started.
            fake(f"zinf-swap-{live.pid}-efgh5678", age=3600),
            fake(f"zinf-swap-{dead}-{start}.{namespace}.00000000.{host}-abcd1234"),  # before the last boot
        ]
        kept = [
            fake(f"zinf-swap-{live.pid}-ijkl9012"),  # older zinf, the live child's pid, made after it started
            fake(f"zinf-swap-{dead}-{start}.1.{boot}.{host}-abcd1234"),  # another pid namespace: unknowable
            fake(f"zinf-swap-{dead}-{start}.{namespace}.00000000.0badc0de-abcd1234"),  # another machine
            fake(f"zinf-swap-notapid-abcd1234"),  # not a swap folder name
            fake(f"my-data-{dead}"),
        ]
        with caplog.at_level("WARNING", logger="zinf"):
            engine = AioEngine(str(tmp_path))
        try:
            assert not os.path.exists(killed_folder)
            for path in stale:
                assert not path.exists(), path
            for path in kept + [pathlib.Path(live_folder), pathlib.Path(engine.folder)]:
                assert path.is_dir(), path
            warning = caplog.text
            assert "removed 6 swap folder(s) under nvme_path" in warning and killed_folder in warning
            assert all(str(path) in warning for path in stale) and "has exited" in warning
            # A second engine (this process) keeps the first one's folder and the live child's.
            with AioEngine(str(tmp_path)) as second:
                assert os.path.isdir(engine.folder) and os.path.isdir(live_folder) and second.folder != engine.folder
        finally:
            engine.close()
    finally:
        live.communicate("", timeout=30)
    assert live.returncode == 0
    assert not os.path.exists(live_folder)  # its own exit removed it


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_swap_folder_is_removed_when_the_process_is_terminated_or_interrupted(signum, tmp_path):
    import subprocess
    import sys
    import textwrap

    # The child restores Python's own SIGINT handler: launched from a background job its parent
    # may ignore SIGINT, and the ignoring would be inherited (a real Ctrl-C raises KeyboardInterrupt).
    script = textwrap.dedent(f"""
        import mmap, signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from zinf_compiler.runtime.aio import AioEngine
        engine = AioEngine({str(tmp_path)!r})
        engine.write("k", mmap.mmap(-1, 4096), 10).wait()
        print(engine.folder, flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    folder = child.stdout.readline().strip()
    assert os.path.isfile(os.path.join(folder, "k.swap")) or os.listdir(folder), folder
    child.send_signal(signum)
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signum, err  # SIGINT: KeyboardInterrupt, exit code -2 once finalizers ran
    assert not os.path.exists(folder)
