"""The RAM cache's choice (zinf_compiler/ram_cache.py): which parameters' states stay in RAM under host_memory.

End to end (a mixed model bit-equal to all-NVMe and to eager): tests/integration/test_ram_cache.py."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zinf_compiler import ram_cache
from zinf_compiler.ram_cache import OPTIMIZER, SHARD, WHOLE, CacheItem
from zinf_compiler.runtime.param_plan import plan_param


def _plan(numel: int, param_tier="nvme", opt_tier="nvme", param_dtype=torch.float32, world_size=1, rank=0,
          partition="allgather"):
    return plan_param(uid=0, shape=(numel,), dtype=torch.float32, device=torch.device("cpu"), stage=3,
                      partition=partition, param_dtype=param_dtype, param_tier=param_tier, opt_tier=opt_tier,
                      world_size=world_size, rank=rank, owner=rank if partition == "broadcast" else None)


def test_items_are_the_nvme_states_sized_per_element():
    plans = [_plan(1000), _plan(500, param_dtype=torch.bfloat16), _plan(300, param_tier="device"), None]
    items = ram_cache.cache_items(plans, [True, True, True, True])
    # Both on NVMe: one item (master and moments read and written, the shard read twice and written).
    assert items == [CacheItem(0, WHOLE, 16000, 36000), CacheItem(1, WHOLE, 7000, 15000),
                     CacheItem(2, OPTIMIZER, 3600, 7200)]
    # A frozen parameter has no optimizer state, only its shard.
    assert ram_cache.cache_items([_plan(1000)], [False]) == [CacheItem(0, SHARD, 4000, 12000)]
    assert ram_cache.grad_bytes(plans, [True, True, False, True]) == 4 * 1500


def test_every_rank_sizes_a_parameter_alike():
    """Ranks choose without a collective: what they size must not depend on the rank."""
    for rank in range(3):
        allgather = ram_cache.cache_items([_plan(1001, world_size=3, rank=rank)], [True])
        assert allgather == [CacheItem(0, WHOLE, 16 * 334, 36 * 334)]
    # A broadcast parameter counts whole on every rank, its owner's or not (as records once adopted).
    owned = _plan(1001, world_size=3, rank=0, partition="broadcast")
    other = plan_param(uid=0, shape=(1001,), dtype=torch.float32, device=torch.device("cpu"), stage=3,
                       partition="broadcast", param_dtype=torch.float32, param_tier="nvme", opt_tier="nvme",
                       world_size=3, rank=1, owner=0)
    assert ram_cache.cache_items([owned], [True]) == ram_cache.cache_items([other], [True])


def test_the_choice_takes_the_best_rate_first_then_graph_order():
    items = [CacheItem(0, SHARD, 100, 200), CacheItem(0, OPTIMIZER, 300, 600), CacheItem(1, OPTIMIZER, 300, 600),
             CacheItem(2, SHARD, 100, 300)]
    assert ram_cache.choose_cached(items, 100) == {(2, SHARD)}  # 3 bytes moved per byte held
    assert ram_cache.choose_cached(items, 400) == {(2, SHARD), (0, OPTIMIZER)}
    # What does not fit is skipped; a smaller item after it may still fit.
    assert ram_cache.choose_cached(items, 500) == {(2, SHARD), (0, OPTIMIZER), (0, SHARD)}
    assert ram_cache.choose_cached(items, 0) == set()


def test_the_budget_leaves_a_quarter_and_what_is_held_never_below_zero():
    assert ram_cache.states_budget(4000, pinned_bytes=1000, held_bytes=500) == 1500
    assert ram_cache.states_budget(1000, pinned_bytes=1000, held_bytes=0) == 0


_items = st.lists(st.tuples(st.sampled_from([OPTIMIZER, SHARD]), st.integers(1, 10_000), st.integers(0, 4)),
                  max_size=30).map(lambda rows: [CacheItem(index, kind, held, held * factor)
                                                 for index, (kind, held, factor) in enumerate(rows)])


@settings(max_examples=200, deadline=None)
@given(_items, st.integers(0, 100_000), st.randoms())
def test_the_choice_fits_the_budget_is_greedy_and_ignores_the_order_it_is_handed(items, budget, random):
    chosen = ram_cache.choose_cached(items, budget)
    by_key = {(item.index, item.kind): item for item in items}
    held = sum(by_key[key].held_bytes for key in chosen)
    assert held <= budget
    # Greedy: every item left out is too big for what was left when its turn came, so for what is left now too.
    for key, item in by_key.items():
        if key not in chosen:
            assert item.held_bytes > budget - held
    shuffled = list(items)
    random.shuffle(shuffled)
    assert ram_cache.choose_cached(shuffled, budget) == chosen


def test_gradients_in_swap_files_are_not_charged_to_the_budget():
    """Under nvme_grad_ram_bytes only that many bytes of nvme-tier gradients rest in RAM: a model whose gradients
    exceed it (every model larger than RAM) still gets its cache (before, every gradient was charged and a 3.2B
    model cached 0.4 GiB of an 18 GiB budget)."""
    plans = [_plan(1000) for _ in range(10)]  # 40,000 bytes of gradients, 160,000 of states
    trained = [True] * 10
    # Without a bound (or one all gradients fit), every gradient is charged and the items are as sized.
    grads, items = ram_cache.grad_charge(plans, trained, ram_cache.cache_items(plans, trained), None)
    assert grads == 40_000 and items == ram_cache.cache_items(plans, trained)
    assert ram_cache.grad_charge(plans, trained, items, 40_000)[0] == 40_000
    # Over the bound: the bound is charged, and a cached parameter brings its gradient into RAM.
    grads, items = ram_cache.grad_charge(plans, trained, ram_cache.cache_items(plans, trained), 8_000)
    assert grads == 8_000 and {item.held_bytes for item in items} == {16_000 + 4_000}
    budget = (8_000 + 3 * 20_000) * 4 // 3 + 4  # a quarter of headroom; the bound; three parameters with gradients
    tiers = ram_cache.choose_tiers(plans, trained, budget, 0, 0, lambda: 0, grad_ram_bytes=8_000)
    assert tiers.count(("cpu", "cpu")) == 3
    assert ram_cache.choose_tiers(plans, trained, budget, 0, 0, lambda: 0).count(("cpu", "cpu")) == 1
