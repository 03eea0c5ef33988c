"""The swap engine (runtime/aio.py) and the pinned pool (runtime/pinned.py)."""

import errno
import os
import stat
import threading
import time

import pytest
import torch

from zinf_compiler.runtime import aio as aio_module
from zinf_compiler.runtime.aio import AioChecksumError, AioEngine, AioError, validate_folder
from zinf_compiler.runtime.pinned import PinnedPool


@pytest.fixture
def engine(tmp_path):
    engine = AioEngine(str(tmp_path), block_size=64 * 1024, threads=3)
    yield engine
    engine.close()


def _fill(pool, numel, seed):
    buffer = pool.acquire(numel * 4)
    buffer.tensor(torch.float32, numel).copy_(torch.randn(numel, generator=torch.Generator().manual_seed(seed)))
    return buffer


def test_round_trip_many_requests_in_flight(engine):
    pool = PinnedPool(8 << 20)
    sizes = [1, 1000, 4097, 70_001, 300_000]  # not multiples of the 4096-byte alignment
    buffers = [_fill(pool, n, i) for i, n in enumerate(sizes)]
    expected = [b.tensor(torch.float32, n).clone() for b, n in zip(buffers, sizes)]
    writes = [engine.write(f"key{i}", b, n * 4) for i, (b, n) in enumerate(zip(buffers, sizes))]
    for request in writes:
        request.wait()
    for buffer, n in zip(buffers, sizes):
        buffer.tensor(torch.float32, n).zero_()
    reads = [engine.read(f"key{i}", b, n * 4) for i, (b, n) in enumerate(zip(buffers, sizes))]
    for request in reads:
        request.wait()
    for buffer, n, want in zip(buffers, sizes, expected):
        assert torch.equal(buffer.tensor(torch.float32, n), want)
    assert engine.bytes_written == engine.bytes_read == 4 * sum(sizes)


def test_private_folder_and_files_removed_at_close(tmp_path):
    engine = AioEngine(str(tmp_path))
    pool = PinnedPool(1 << 20)
    engine.write("a", _fill(pool, 100, 0), 400).wait()
    assert stat.S_IMODE(os.stat(engine.folder).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(engine.path("a")).st_mode) == 0o600
    engine.close()
    assert not os.path.exists(engine.folder)


def test_validate_folder_errors(tmp_path, monkeypatch):
    with pytest.raises(AioError, match="does not exist.*mkdir"):
        validate_folder(str(tmp_path / "missing"), 1)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(AioError, match="not a folder"):
        validate_folder(str(a_file), 1)
    monkeypatch.setattr(aio_module.os, "access", lambda path, mode: False)
    with pytest.raises(AioError, match="not writable"):
        validate_folder(str(tmp_path), 1)
    monkeypatch.undo()
    free = os.statvfs(str(tmp_path)).f_bavail * os.statvfs(str(tmp_path)).f_frsize
    with pytest.raises(AioError, match=r"nvme_path .* free .* needs") as err:
        validate_folder(str(tmp_path), free * 2)
    assert f"{free * 2:,}" in str(err.value)


def test_enospc_mid_write_keeps_the_last_good_copy(engine, monkeypatch):
    pool = PinnedPool(1 << 20)
    good = _fill(pool, 50_000, 1)
    good_values = good.tensor(torch.float32, 50_000).clone()
    engine.write("state", good, 200_000).wait()
    calls = {"n": 0}
    real_pwritev = os.pwritev

    def failing_pwritev(fd, buffers, offset):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(aio_module.os, "pwritev", failing_pwritev)
    newer = _fill(pool, 50_000, 2)
    with pytest.raises(AioError, match="full .ENOSPC.*last good copy"):
        engine.write("state", newer, 200_000).wait()
    monkeypatch.undo()
    newer.tensor(torch.float32, 50_000).zero_()
    engine.read("state", newer, 200_000).wait()
    assert torch.equal(newer.tensor(torch.float32, 50_000), good_values)


def test_transaction_commits_all_or_nothing(engine):
    pool = PinnedPool(1 << 20)
    first, second = _fill(pool, 1000, 1), _fill(pool, 1000, 2)
    engine.write("x", first, 4000).wait()
    before = first.tensor(torch.float32, 1000).clone()
    with pytest.raises(RuntimeError, match="boom"):
        with engine.transaction():
            engine.write("x", second, 4000).wait()
            raise RuntimeError("boom")
    engine.read("x", first, 4000).wait()
    assert torch.equal(first.tensor(torch.float32, 1000), before)
    with engine.transaction():
        engine.write("x", second, 4000).wait()
    engine.read("x", first, 4000).wait()
    assert torch.equal(first.tensor(torch.float32, 1000), second.tensor(torch.float32, 1000))


def test_corrupted_swap_file_is_an_error(engine):
    pool = PinnedPool(1 << 20)
    buffer = _fill(pool, 10_000, 3)
    engine.write("w", buffer, 40_000).wait()
    with open(engine.path("w"), "r+b") as handle:  # flip one byte of the written slot
        handle.seek(123)
        byte = handle.read(1)
        handle.seek(123)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(AioChecksumError, match="corrupt"):
        engine.read("w", buffer, 40_000).wait()


def test_pinned_pool_reuses_aligned_blocks_and_waits_when_full():
    pool = PinnedPool(64 * 1024)
    first = pool.acquire(5000)
    assert first.address % 4096 == 0 and first.nbytes == 8192
    first_offset = first.offset
    first.release()
    again = pool.acquire(5000)
    assert again.offset == first_offset  # reused, not fresh memory
    rest = pool.acquire(64 * 1024 - 8192)
    assert pool.in_use_bytes == pool.capacity_bytes

    def release_later():
        time.sleep(0.2)
        again.release()

    threading.Thread(target=release_later).start()
    waited = pool.acquire(4096, timeout=5)  # blocks until the other thread releases
    assert pool.waits == 1 and pool.in_use_bytes <= pool.capacity_bytes
    with pytest.raises(TimeoutError, match="in use"):
        pool.acquire(8192, timeout=0.05)
    with pytest.raises(ValueError, match="pinned_bytes"):
        pool.acquire(1 << 20)
    waited.release()
    rest.release()
    assert pool.in_use_bytes == 0 and pool.peak_in_use_bytes == pool.capacity_bytes


def test_pinned_pool_never_exceeds_capacity_under_threads():
    pool = PinnedPool(32 * 1024)
    worst = []

    def worker(seed):
        for i in range(50):
            with pool.acquire(4096 * (1 + (seed + i) % 3)):
                worst.append(pool.in_use_bytes)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert max(worst) <= pool.capacity_bytes and pool.in_use_bytes == 0
