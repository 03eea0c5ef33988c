"""The pinned pool (runtime/pinned.py): one bounded, reused pool of aligned host buffers."""

import threading
import time

import pytest
import torch

from zinf_compiler.runtime.pinned import PinnedPool

KiB = 1024


def test_blocks_are_aligned_rounded_and_reused():
    pool = PinnedPool(64 * KiB)
    assert pool.capacity_bytes == 64 * KiB and pool.base_address % 4096 == 0
    first = pool.acquire(5000)
    assert first.nbytes == 8192 and first.address % 4096 == 0
    address = first.address
    first.release()
    again = pool.acquire(5000)
    assert again.address == address  # the same memory, not a fresh allocation
    second = pool.acquire(1)
    assert second.nbytes == 4096 and second.address % 4096 == 0
    assert pool.in_use_bytes == 8192 + 4096 == pool.peak_in_use_bytes
    again.release()
    second.release()
    second.release()  # idempotent
    assert pool.in_use_bytes == 0 and pool.buffers_in_use == 0
    whole = pool.acquire(64 * KiB)  # released blocks coalesced back into one
    assert whole.offset == 0
    whole.release()


def test_views_share_the_block_memory():
    pool = PinnedPool(16 * KiB)
    with pool.acquire(4000) as buffer:
        values = buffer.tensor(torch.float32, 1000)
        values.copy_(torch.arange(1000, dtype=torch.float32))
        assert values.data_ptr() == buffer.address
        view = buffer.memoryview()
        assert len(view) == buffer.nbytes and not view.readonly
        assert bytes(view[4:8]) == torch.tensor([1.0]).numpy().tobytes()
        assert buffer.tensor(torch.float64).numel() == buffer.nbytes // 8
        with pytest.raises(ValueError, match="does not fit"):
            buffer.tensor(torch.float32, 1025)
    assert pool.in_use_bytes == 0
    with pytest.raises(ValueError, match="released"):
        buffer.memoryview()


def test_records_whether_the_memory_is_page_locked():
    pool = PinnedPool(16 * KiB)
    assert isinstance(pool.pinned, bool) and isinstance(pool.locked, bool)
    if not torch.cuda.is_available():
        assert not pool.pinned  # CPU-only: mlock at most
    assert pool.locked or pool.lock_error
    plain = PinnedPool(16 * KiB, pin=False)
    assert not plain.pinned and not plain.locked


def test_larger_alignment():
    pool = PinnedPool(256 * KiB, alignment=64 * KiB)
    blocks = [pool.acquire(1), pool.acquire(64 * KiB + 1)]
    assert all(b.address % (64 * KiB) == 0 for b in blocks)
    assert [b.nbytes for b in blocks] == [64 * KiB, 128 * KiB]


def test_exhausted_pool_waits_until_another_thread_releases():
    pool = PinnedPool(32 * KiB)
    held = [pool.acquire(16 * KiB), pool.acquire(16 * KiB)]
    freed_address = held[0].address
    released, acquired = threading.Event(), threading.Event()

    def release_once_the_acquire_waits():
        # The acquire counts its wait (pool.waits) under the pool's lock and then waits on it; the release
        # takes that lock, so it comes after the acquire is waiting, however loaded the machine: no sleep
        # decides the order. (An acquire that does not wait ends the poll; its deadline only stops the thread.)
        deadline = time.monotonic() + 60
        while pool.waits == 0 and not acquired.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        released.set()
        held[0].release()

    thread = threading.Thread(target=release_once_the_acquire_waits)
    thread.start()
    got = pool.acquire(8 * KiB, timeout=60)
    returned_after_the_release = released.is_set()
    acquired.set()
    thread.join()
    assert returned_after_the_release and pool.waits == 1
    assert got.address == freed_address  # the released block, not memory another buffer still holds
    assert pool.in_use_bytes == 24 * KiB
    got.release()
    held[1].release()


def test_oversize_request_names_the_sizes_and_the_option():
    pool = PinnedPool(64 * KiB)
    with pytest.raises(ValueError, match=r"1,048,576-byte .* 65,536 bytes .*pinned_bytes"):
        pool.acquire(1 << 20)


def test_timeout_names_what_is_in_use():
    pool = PinnedPool(16 * KiB)
    held = pool.acquire(12 * KiB)
    with pytest.raises(TimeoutError, match=r"1 buffers in use hold 12,288 of 16,384 bytes.*pinned_bytes"):
        pool.acquire(8 * KiB, timeout=0.05)
    assert pool.waits == 1
    held.release()


def test_never_allocates_past_capacity_under_concurrent_threads():
    pool = PinnedPool(40 * KiB)
    observed = []
    errors = []

    def worker(seed):
        try:
            for step in range(200):
                with pool.acquire(4096 * (1 + (seed * 7 + step) % 5), timeout=10) as buffer:
                    observed.append(pool.in_use_bytes)
                    buffer.memoryview()[:8] = bytes(8)
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert max(observed) <= pool.capacity_bytes
    assert pool.peak_in_use_bytes <= pool.capacity_bytes
    assert pool.in_use_bytes == 0 and pool.buffers_in_use == 0
    assert pool.acquire(40 * KiB).offset == 0  # fully coalesced again
