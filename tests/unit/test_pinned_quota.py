"""The process's pinned memory (runtime/pinned.py's PinnedMemory): one allocator, a named quota per consumer.

No compile: the allocator and the stores that draw from it, alone.
"""

import gc

import pytest

from zinf_compiler.api import RUNTIME
from zinf_compiler.runtime.ledger import Ledger
from zinf_compiler.runtime.pinned import PinnedMemory
from zinf_compiler.runtime.store import ParamStore

KiB = 1024


def _counted_memory():
    counted = []
    return PinnedMemory(counted.append), counted


def test_a_full_quota_waits_and_raises_as_a_pool_without_taking_another_consumers_bytes():
    memory, _ = _counted_memory()
    parameters = memory.quota("parameters", 16 * KiB)
    activations = memory.quota("activations", 16 * KiB)
    held = parameters.acquire(16 * KiB)
    with pytest.raises(TimeoutError, match="1 buffers in use hold 16,384 of 16,384 bytes"):
        parameters.acquire(4 * KiB, timeout=0.05)
    with pytest.raises(ValueError, match="does not fit"):
        parameters.acquire(32 * KiB)  # past the quota: raises at once, as a pool of that size does
    # The other consumer's quota is untouched: all of it is still there.
    with activations.acquire(16 * KiB) as whole:
        assert whole.offset == 0
    assert parameters.waits == 1 and activations.waits == 0
    held.release()


def test_figures_add_up_per_consumer_and_each_quota_counts_once():
    memory, counted = _counted_memory()
    first = memory.quota("early_optimizer", 20 * KiB)  # 20 KiB: a multiple of the 4 KiB alignment
    second = memory.quota("early_optimizer", 8 * KiB)  # a second optimizer's: the consumer adds both
    staging = memory.quota("activations", 5000)
    assert staging.capacity_bytes == 8 * KiB  # rounded up to the alignment, as a pool is
    assert counted == [20 * KiB, 8 * KiB, 8 * KiB]
    buffers = [first.acquire(12 * KiB), second.acquire(4 * KiB), staging.acquire(1)]
    buffers[0].release()
    figures = memory.figures()
    assert set(figures) == {"early_optimizer", "activations"}
    assert figures["early_optimizer"] == {"quota": 28 * KiB, "in_use": 4 * KiB, "peak": 16 * KiB,
                                          "pinned": first.locked and second.locked}
    assert figures["activations"] == {"quota": 8 * KiB, "in_use": 4 * KiB, "peak": 4 * KiB, "pinned": staging.locked}
    assert sum(f["quota"] for f in figures.values()) == sum(counted) == 36 * KiB
    assert all(isinstance(f["pinned"], bool) for f in figures.values())
    for buffer in buffers[1:]:
        buffer.release()
    assert all(f["in_use"] == 0 for f in memory.figures().values())


def test_close_or_drop_gives_the_quota_back_once():
    memory, counted = _counted_memory()
    staging = memory.quota("activations", 16 * KiB)
    held = staging.acquire(4 * KiB)
    staging.close()
    staging.close()  # idempotent: uncounted once
    assert counted == [16 * KiB, -16 * KiB]
    assert memory.figures()["activations"] == {"quota": 0, "in_use": 4 * KiB, "peak": 4 * KiB, "pinned": False}
    with pytest.raises(RuntimeError, match="closed"):
        staging.acquire(1)
    held.release()  # a buffer released after close still leaves the figures
    assert memory.figures()["activations"]["in_use"] == 0
    dropped = memory.quota("early_optimizer", 8 * KiB)  # an optimizer dropped with its pool: never closed
    del dropped
    gc.collect()
    assert counted[-2:] == [8 * KiB, -8 * KiB]
    assert memory.figures()["early_optimizer"]["quota"] == 0


def test_a_pageable_quota_says_so():
    memory, _ = _counted_memory()
    memory.quota("activations", 4 * KiB, pin=False)
    plain = memory.quota("activations", 4 * KiB, pin=False)
    assert not plain.locked and memory.figures()["activations"]["pinned"] is False


def test_the_runtime_hands_one_allocator_to_the_stores_and_counts_it_in_the_process_figures():
    assert RUNTIME.store.pinned_memory is RUNTIME.pinned_memory
    assert RUNTIME.activations._pinned_memory is RUNTIME.pinned_memory
    store = ParamStore(RUNTIME.comm)  # a store of its own: an allocator of its own, counted in its ledger
    assert isinstance(store.process, Ledger) and store.pinned_memory is not RUNTIME.pinned_memory
    before = store.process.resting["cpu"]
    store.configure_offload(None, 1 << 20, 1 << 20, 8, 1)
    pool = store.pinned_pool(4 * KiB)
    assert pool is store.pinned and store.pinned_pool(4 * KiB) is pool  # made once
    assert store.process.resting["cpu"] - before == pool.capacity_bytes == 1 << 20
    assert store.pinned_memory.figures() == {"parameters": {"quota": 1 << 20, "in_use": 0, "peak": 0,
                                                            "pinned": pool.locked}}


def _nvme_plan(numel: int, uid: int):
    import torch

    from zinf_compiler.runtime.param_plan import plan_param
    return plan_param(uid=uid, shape=(numel,), dtype=torch.float32, device=torch.device("cpu"), stage=3,
                      partition="allgather", param_dtype=torch.float32, param_tier="nvme", opt_tier="nvme",
                      world_size=1, rank=0)


def test_the_parameters_pool_is_sized_to_a_small_model_and_floored_for_a_large_one():
    from zinf_compiler.runtime.pool_sizes import POOL_FLOOR, grad_write_reserve_bytes, parameter_pool_bytes
    from zinf_compiler.runtime.swap_layout import align

    small = [_nvme_plan(10_000, uid) for uid in range(4)]  # 160 KB of fp32 slices in all
    everything = sum(align(plan.local_numel * 4) for plan in small) + grad_write_reserve_bytes(small)
    assert parameter_pool_bytes(40_000, small) == everything < POOL_FLOOR  # (was 64 MiB whatever the model)
    large = [_nvme_plan(1 << 20, uid) for uid in range(32)]  # 128 MiB of slices: the floor's room for prefetch
    assert parameter_pool_bytes(4 << 20, large) == POOL_FLOOR
    # Nothing planned yet: one block, never an empty pool.
    assert parameter_pool_bytes(0, []) == 4096


def test_a_pool_made_for_a_first_graph_grows_for_the_next_while_nothing_is_in_use(tmp_path):
    store = ParamStore(RUNTIME.comm, pinned_memory=PinnedMemory())
    store.configure_offload(str(tmp_path), "auto", 1 << 20, 4, 1)
    store.plan_shards([_nvme_plan(1_000, 0)])
    first = store.pinned_pool(4000)
    store.plan_shards([_nvme_plan(100_000, 1)])  # a later graph's larger parameter
    assert store.pinned is not first and store.pinned.capacity_bytes > first.capacity_bytes
    grown = store.pinned
    held = grown.acquire(4096)  # (in use: a pool with buffers out is never replaced)
    store.plan_shards([_nvme_plan(1_000_000, 2)])
    assert store.pinned is grown
    held.release()
    # An explicit pinned_bytes is the user's: never changed.
    fixed = ParamStore(RUNTIME.comm, pinned_memory=PinnedMemory())
    fixed.configure_offload(str(tmp_path), 64 * KiB, 1 << 20, 4, 1)
    fixed.plan_shards([_nvme_plan(1_000, 0)])
    made = fixed.pinned_pool(4000)
    fixed.plan_shards([_nvme_plan(100_000, 1)])
    assert fixed.pinned is made and made.capacity_bytes == 64 * KiB
