"""In-process unit tests of the store's transfers (issue 27: a fast tier; no compile, no process group).

Each test builds a store of its own (``ParamStore(RUNTIME.comm)``, world size 1) and
drives one unit through the steps the graph's ops take: nc (NVMe -> pinned
buffer), cg (CPU or pinned -> device), gather, release, and the gradient's
reduce, in the legal orders and in illegal ones, which must raise naming the
op and the unit instead of pairing with another transfer.
"""

from __future__ import annotations

import importlib
import itertools
import types

import pytest
import torch

from adopting import adopt_in

from zinf_compiler.runtime.ledger import ZinfStoreError
from zinf_compiler.api import RUNTIME
from zinf_compiler.runtime.store import ParamStore
from zinf_compiler.runtime.transfers import LEGAL_TRANSITIONS, Transfer, TransferState as State, TransferTable
from zinf_compiler.runtime.transfers import ZinfTransferError


@pytest.fixture
def store(tmp_path):
    store = ParamStore(RUNTIME.comm)
    store.configure_offload(str(tmp_path), 16 << 20, aio_block_size=1 << 20, aio_queue_depth=4, aio_threads=1)
    yield store
    for engine in store.engines():
        engine.close()
    if store.pinned is not None:
        store.pinned.close()


_ALIVE: list = []  # the store holds parameters weakly: a collected one's state is freed


@pytest.fixture(autouse=True)
def _params_live_for_the_test():
    yield
    _ALIVE.clear()


def _adopt(store: ParamStore, tier: str, rows: int = 6, name: str = "w") -> tuple[torch.Tensor, object]:
    """A stage-3 parameter adopted on ``tier``: its value before, and its record."""
    torch.manual_seed(rows)
    param = torch.nn.Parameter(torch.randn(rows, 5))
    _ALIVE.append(param)
    expected = param.detach().clone()
    record = adopt_in(store, param, name, stage=3, partition="allgather", param_dtype="fp32", param_tier=tier)
    store.release_full_storage([record])
    return expected, record


@pytest.mark.parametrize("tier", ["device", "cpu", "nvme"])
def test_each_tier_fetches_the_value_by_its_steps_and_gives_every_byte_back(store, tier):
    expected, record = _adopt(store, tier)
    unit = store.unit([record])
    if tier == "nvme":
        store.nc_start(unit)
        store.nc_wait(unit)
        assert store.pinned.in_use_bytes > 0
    if tier != "device":
        store.cg_start(unit)
        store.cg_wait(unit)
    store.gather_start(unit)
    (value,) = store.gather_wait(unit)
    assert torch.equal(value.view_as(expected), expected)
    assert record.ledger.transient["device"] > 0
    store.release(unit)
    assert record.ledger.transient["device"] == 0 and store.transient["device"] == 0
    assert store.pinned is None or store.pinned.in_use_bytes == 0


def test_a_gather_without_its_fetch_steps_fetches_synchronously(store):
    expected, record = _adopt(store, "nvme")
    unit = store.unit([record])
    store.gather_start(unit)  # no nc/cg ran (outside a graph): fetched here
    assert torch.equal(store.gather_wait(unit)[0].view_as(expected), expected)
    store.release(unit)
    assert store.pinned.in_use_bytes == 0


@pytest.mark.parametrize("op", ["nc_wait", "cg_wait", "gather_wait", "reduce_grad_wait"])
def test_a_wait_without_its_start_raises_naming_the_op_and_the_unit(store, op):
    _, record = _adopt(store, "nvme")
    unit = store.unit([record])
    with pytest.raises(ZinfStoreError, match=rf"{op} for w without"):
        getattr(store, op)(unit)


def test_a_copy_to_the_device_of_an_nvme_unit_before_its_read_raises(store):
    _, record = _adopt(store, "nvme")
    with pytest.raises(ZinfTransferError, match=r"cg_start for w without a matching start: it needs a transfer that "
                                                r"is read, and the unit has nothing in flight"):
        store.cg_start(store.unit([record]))


def test_the_state_table_allows_exactly_the_documented_moves():
    """Every (from, to, op) triple: the documented moves succeed, every other one raises and moves nothing."""
    unit = types.SimpleNamespace(key="u", name="u")
    ops = sorted(set(LEGAL_TRANSITIONS.values()))
    assert ops == ["cg_start", "cg_wait", "gather_start", "gather_wait", "nc_start", "nc_wait",
                   "reduce_grad_start", "reduce_grad_wait"]
    moved = 0
    for source, target, op in itertools.product(State, State, ops):
        table = TransferTable()
        if source is not State.NEW:
            table._by_unit["u"] = [Transfer("u", state=source)]  # a transfer already in ``source``
        if LEGAL_TRANSITIONS.get((source, target)) == op:
            transfer = table.move(unit, op, source, target)
            assert transfer.state is target and table.has(unit, target) == (target is not State.DONE)
            moved += 1
        else:
            with pytest.raises(ZinfTransferError, match=op):
                table.move(unit, op, source, target)
            assert [t.state for t in table] == ([] if source is State.NEW else [source])
    assert moved == len(LEGAL_TRANSITIONS) == 10


def _drive_to(store: ParamStore, unit, state: State) -> None:
    """Move a fresh nvme unit's one transfer to ``state`` by the ops the graph would call."""
    steps = {State.READING: ["nc_start"], State.READ: ["nc_start", "nc_wait"],
             State.COPYING: ["nc_start", "nc_wait", "cg_start"],
             State.STAGED: ["nc_start", "nc_wait", "cg_start", "cg_wait"],
             State.GATHERING: ["gather_start"], State.NEW: []}
    if state is State.REDUCING:
        store.reduce_grad_start(unit, [torch.ones(6, 5)])
        return
    for op in steps[state]:
        getattr(store, op)(unit)


# The ops that continue a transfer, and the state each needs (for an nvme unit).
_CONTINUING = {"nc_wait": State.READING, "cg_start": State.READ, "cg_wait": State.COPYING,
               "gather_wait": State.GATHERING, "reduce_grad_wait": State.REDUCING}


@pytest.mark.parametrize("op", sorted(_CONTINUING))
def test_every_op_that_continues_a_transfer_raises_from_every_other_state(store, op):
    """In the store: the op works from its state and raises from each other one, leaving the transfer where it was."""
    _, record = _adopt(store, "nvme")
    record.param.requires_grad_(True)
    unit = store.unit([record])
    for state in (State.NEW, State.READING, State.READ, State.COPYING, State.STAGED, State.GATHERING,
                  State.REDUCING):
        _drive_to(store, unit, state)
        if state is _CONTINUING[op]:
            getattr(store, op)(unit)
            assert not store._transfers.has(unit, state)
        else:
            with pytest.raises(ZinfTransferError, match=rf"{op} for w without a matching start: it needs a "
                                                        rf"transfer that is {_CONTINUING[op].value}"):
                getattr(store, op)(unit)
            assert [t.state for t in store._transfers] == ([] if state is State.NEW else [state])
        store.abandon_transfers()
        assert not store._transfers and store.pinned.in_use_bytes == 0 and store.transient["device"] == 0


def test_transfers_of_one_unit_pair_first_in_first_out_and_units_do_not_mix(store):
    first_value, first = _adopt(store, "cpu", rows=6, name="a")
    second_value, second = _adopt(store, "cpu", rows=8, name="b")
    unit_a, unit_b = store.unit([first]), store.unit([second])
    store.gather_start(unit_a)
    store.gather_start(unit_b)
    store.gather_start(unit_a)  # a second gather of a in flight (a prefetch for the backward)
    assert torch.equal(store.gather_wait(unit_b)[0].view_as(second_value), second_value)
    for _ in range(2):
        assert torch.equal(store.gather_wait(unit_a)[0].view_as(first_value), first_value)
    with pytest.raises(ZinfStoreError, match="gather_wait for a without a matching start"):
        store.gather_wait(unit_a)
    for unit in (unit_a, unit_b, unit_a):
        store.release(unit)
    assert store.transient["device"] == 0


def test_a_bucket_is_one_unit_and_gathers_each_parameter(store):
    values, records = zip(*(_adopt(store, "cpu", rows=rows, name=f"p{rows}") for rows in (3, 4, 7)))
    unit = store.unit(records)
    assert unit is store.unit(records)  # built once
    store.gather_start(unit)
    for value, gathered in zip(values, store.gather_wait(unit)):
        assert torch.equal(gathered.view_as(value), value)
    store.release(unit)


def test_abandoned_transfers_give_their_pinned_buffers_and_counted_bytes_back(store):
    _, record = _adopt(store, "nvme")
    unit = store.unit([record])
    store.nc_start(unit)
    store.nc_start(unit)
    store.nc_wait(unit)
    store.cg_start(unit)  # one read went on to the device copy, one is still read
    assert store.pinned.in_use_bytes > 0 and record.ledger.transient["device"] > 0
    store.abandon_transfers()  # a graph raised half way
    assert store.pinned.in_use_bytes == 0
    assert record.ledger.transient["device"] == 0 and store.transient["device"] == 0
    with pytest.raises(ZinfStoreError, match="cg_wait for w without"):
        store.cg_wait(unit)  # the next call's waits never pair with the stale starts


@pytest.mark.parametrize("opt_tier", ["device", "cpu"])
def test_reduced_gradients_add_up_in_the_gradient_shard_until_dropped(store, opt_tier):
    param = torch.nn.Parameter(torch.randn(4, 3))
    record = adopt_in(store, param, "g", stage=2, partition="allgather", param_dtype="fp32", opt_tier=opt_tier)
    unit = store.unit([record])
    grads = [torch.randn(4, 3), torch.randn(4, 3)]
    for grad in grads:
        store.reduce_grad_start(unit, [grad])
        store.reduce_grad_wait(unit)
    assert torch.allclose(record.gradient.shard.view(4, 3), grads[0] + grads[1])
    assert record.gradient.shard.device.type == "cpu"
    held = store.resting["device" if opt_tier == "device" else "cpu"]
    store.drop_grads([record])
    assert record.gradient.shard is None and store.resting["device" if opt_tier == "device" else "cpu"] < held
    with pytest.raises(ZinfStoreError, match="2 gradients for 1 parameters"):
        store.reduce_grad_start(unit, grads)


def test_a_collected_parameter_frees_its_shard_and_its_counted_bytes(store):
    param = torch.nn.Parameter(torch.randn(6, 5))
    adopt_in(store, param, "gone", stage=3, partition="allgather", param_dtype="fp32", param_tier="cpu")
    assert store.resting["cpu"] > 0 and len(store.records()) == 1
    del param
    store.collect()  # (the weakref callback only queued it)
    assert store.records() == [] and store.resting == {"device": 0, "cpu": 0}


def test_a_parameter_keeps_the_mesh_it_was_adopted_with(store):
    from zinf_compiler import adoption
    from zinf_compiler.options import parse_options
    from zinf_compiler.runtime.comm import MeshComm

    param = torch.nn.Parameter(torch.randn(4, 4))
    record = adopt_in(store, param, "m", stage=3, partition="allgather", param_dtype="fp32")
    assert record.mesh is RUNTIME.comm.mesh() and record.mesh.is_default and record.mesh.everyone is RUNTIME.comm
    options = parse_options({"stage": 3})
    assert adoption.adopt(store, param, "m", options, RUNTIME.comm.mesh(), None) is record
    with pytest.raises(ZinfStoreError, match="same stage, partition, param_dtype, offload options and mesh"):
        adoption.adopt(store, param, "m", options, MeshComm(RUNTIME.comm), None)


def test_the_graph_ops_reach_the_store_of_the_call_they_run_in(store):
    importlib.import_module("zinf_compiler.ops")  # registers torch.ops.zinf
    from zinf_compiler.runtime import binding

    expected, record = _adopt(store, "nvme")
    zinf, cpu = torch.ops.zinf, torch.device("cpu")
    with pytest.raises(binding.ZinfBindingError):
        zinf.nc_start([0], cpu)  # no call in progress: no store to reach
    process_pinned = RUNTIME.store.pinned.in_use_bytes if RUNTIME.store.pinned is not None else 0
    with binding.bound(binding.Binding({0: record}, graph_id=7, store=store)):
        token = zinf.nc_wait(zinf.nc_start([0], cpu), [0])
        assert store.pinned.in_use_bytes > 0  # this store's pool, not the process store's
        token = zinf.cg_wait(zinf.cg_start([0], cpu, token), [0])
        (value,) = zinf.gather_wait(zinf.gather_start([0], cpu, token), [0], list(expected.shape), [2],
                                    torch.float32)
        assert torch.equal(value, expected)
        zinf.release([value], [0])
        with pytest.raises(binding.ZinfBindingError, match="graph 7: no parameter bound to input slot 1"):
            zinf.nc_start([1], cpu)
    assert store.pinned.in_use_bytes == 0 and store.transient["device"] == 0
    assert (RUNTIME.store.pinned.in_use_bytes if RUNTIME.store.pinned is not None else 0) == process_pinned


@pytest.mark.parametrize("local_ranks", ["1", "2"])
def test_auto_gradient_ram_is_an_eighth_of_the_memory_available_shared_by_the_nodes_ranks(
        store, monkeypatch, local_ranks):
    """nvme_grad_ram_bytes="auto": the budget is fixed at the first adoption that asks (later allocations
    do not shrink it); parameters take it in adoption order, the rest keep their gradients on disk."""
    import zinf_compiler.runtime.store as store_module

    grad_bytes = 6 * 5 * 4  # one _adopt parameter's fp32 gradient
    available = iter([8 * 2 * grad_bytes * int(local_ranks), 0])  # the second reading must not be taken
    monkeypatch.setattr(store_module, "available_bytes", lambda: next(available))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    records = []
    for index in range(3):
        param = torch.nn.Parameter(torch.randn(6, 5))
        _ALIVE.append(param)
        records.append(adopt_in(store, param, f"p{index}", stage=3, partition="allgather", param_dtype="fp32",
                                   param_tier="nvme", opt_tier="nvme", grad_ram_bytes="auto"))
    assert [record.grad_in_ram for record in records] == [True, True, False]
