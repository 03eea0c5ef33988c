"""The RAM cache's choice (zinf_compiler/ram_cache.py): which parameters' states stay in RAM under host_memory.

End to end (a mixed model bit-equal to all-NVMe and to eager): tests/integration/test_ram_cache.py."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zinf_compiler import ram_cache
from zinf_compiler.ram_cache import OPTIMIZER, SHARD, WHOLE, CacheItem
from zinf_compiler.runtime.param_plan import plan_param


def _plan(numel: int, param_tier="nvme", opt_tier="nvme", param_dtype=torch.float32, world_size=1, rank=0,
          partition="allgather", requires_grad=True):
    return plan_param(uid=0, shape=(numel,), dtype=torch.float32, device=torch.device("cpu"), stage=3,
                      partition=partition, param_dtype=param_dtype, param_tier=param_tier, opt_tier=opt_tier,
                      world_size=world_size, rank=rank, owner=0 if partition == "broadcast" else None,
                      requires_grad=requires_grad)


def _replan(plans):
    """What plan_model hands the cache: a parameter's plan on other tiers (its shape, dtype and mesh kept)."""
    def replan(index, param_tier, opt_tier):
        plan = plans[index]
        return plan_param(uid=plan.uid, shape=plan.shape, dtype=plan.dtype, device=plan.device, stage=plan.stage,
                          partition=plan.partition, param_dtype=plan.compute_dtype, param_tier=param_tier,
                          opt_tier=opt_tier, world_size=plan.world_size, rank=plan.rank, owner=plan.owner,
                          requires_grad=plan.requires_grad)
    return replan


def test_items_are_the_nvme_states_sized_by_the_plans_byte_model():
    plans = [_plan(1000), _plan(500, param_dtype=torch.bfloat16), _plan(300, param_tier="device"), None]
    items = ram_cache.cache_items(plans, _replan(plans))
    # Both on NVMe: one item. fp32 on the cpu tier: the shard is the master (4 bytes) beside two moments (8); on
    # NVMe the shard is read from the master's files twice, and master and moments read and written.
    # bf16: a 2-byte shard beside a 12-byte master and moments; the shard read twice and written back.
    assert items == [CacheItem(0, WHOLE, 12000, 32000), CacheItem(1, WHOLE, 7000, 15000),
                     CacheItem(2, OPTIMIZER, 3600, 7200)]
    # A frozen parameter has no optimizer state, only its shard, read twice and never written.
    frozen = [_plan(1000, requires_grad=False)]
    assert ram_cache.cache_items(frozen, _replan(frozen)) == [CacheItem(0, SHARD, 4000, 8000)]
    plans[2] = _plan(300, param_tier="device", requires_grad=False)
    assert ram_cache.grad_bytes(plans) == 4 * 1500
    # Each item's figures are what the plans themselves say they hold and move on the cpu and nvme tiers.
    cached = _replan(plans)(0, "cpu", "cpu").state_bytes()["cpu"]
    assert cached["params"] + cached["optimizer"] == 12000
    assert sum(plans[0].traffic(grad_in_ram=True)[:2]) == 32000


def test_every_rank_sizes_a_parameter_alike():
    """Ranks choose without a collective: what they size must not depend on the rank."""
    for rank in range(3):
        plans = [_plan(1001, world_size=3, rank=rank)]
        assert ram_cache.cache_items(plans, _replan(plans)) == [CacheItem(0, WHOLE, 12 * 334, 32 * 334)]
    # A broadcast parameter counts whole on every rank, its owner's or not (as records once adopted).
    owned = [_plan(1001, world_size=3, rank=0, partition="broadcast")]
    other = [_plan(1001, world_size=3, rank=1, partition="broadcast")]
    assert other[0].local_numel == 0
    assert ram_cache.cache_items(owned, _replan(owned)) == ram_cache.cache_items(other, _replan(other))


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
    plans = [_plan(1000) for _ in range(10)]  # 40,000 bytes of gradients, 120,000 of states
    items = ram_cache.cache_items(plans, _replan(plans))
    # Without a bound (or one all gradients fit), every gradient is charged and the items are as sized.
    grads, charged = ram_cache.grad_charge(plans, items, None)
    assert grads == 40_000 and charged == items
    assert ram_cache.grad_charge(plans, items, 40_000)[0] == 40_000
    # Over the bound: the bound is charged, and a cached parameter brings its gradient into RAM.
    grads, charged = ram_cache.grad_charge(plans, items, 8_000)
    assert grads == 8_000 and {item.held_bytes for item in charged} == {12_000 + 4_000}
    budget = (8_000 + 3 * 16_000) * 4 // 3 + 4  # a quarter of headroom; the bound; three parameters with gradients
    tiers = ram_cache.choose_tiers(plans, _replan(plans), budget, 0, 0, 0, grad_ram_bytes=8_000)
    assert tiers.count(("cpu", "cpu")) == 3
    assert ram_cache.choose_tiers(plans, _replan(plans), budget, 0, 0, 0).count(("cpu", "cpu")) == 1
