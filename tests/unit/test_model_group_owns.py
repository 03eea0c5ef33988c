"""What belongs to one model lives in its ModelGroup (runtime/model_group.py), not in a map of the process-wide
ParamStore keyed by group: the values and gradients a pipeline step holds are the group's own."""

import gc
import weakref

import pytest
import torch

from adopting import adopt_in

from zinf_compiler.api import RUNTIME
from zinf_compiler.runtime.model_group import ModelGroup
from zinf_compiler.runtime.comm import MeshComm
from zinf_compiler.runtime.ledger import ZinfStoreError
from zinf_compiler.runtime.store import ParamStore


def maps_keyed_by_group(store: ParamStore) -> list[str]:
    """The store's attributes that are maps with a ModelGroup among their keys."""
    return sorted(name for name, value in vars(store).items()
                  if isinstance(value, (dict, weakref.WeakKeyDictionary))
                  and any(isinstance(key, ModelGroup) for key in list(value.keys())))


def _two_models_holding() -> tuple[ParamStore, list[ModelGroup]]:
    """A store with two models' parameters adopted, each with its gathers and gradients held (as a pipeline
    stage holds them for a step)."""
    store = ParamStore(RUNTIME.comm)
    groups = []
    for model in range(2):
        params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
        group = store.claim(params)
        for index, param in enumerate(params):
            adopt_in(store, param, f"m{model}.p{index}", stage=3, partition="allgather", param_dtype="fp32",
                        param_tier="device", opt_tier="device")
        groups.append(group)
        group.params = params  # (kept alive with the group for the test)
    store.hold_gathers(groups)
    store.hold_grads(groups)
    return store, groups


def test_the_store_keeps_no_map_keyed_by_model_group():
    store, groups = _two_models_holding()
    assert groups[0] is not groups[1]
    assert all(group.held_gathers == {} and group.grad_hold is not None for group in groups)
    assert maps_keyed_by_group(store) == []
    store.end_held_gathers(groups)
    store.end_held_grads(groups, reduced=False)
    assert all(group.held_gathers is None and group.grad_hold is None for group in groups)
    assert not store._holding_groups


def test_the_check_sees_a_planted_map_keyed_by_group():
    store, groups = _two_models_holding()
    store._held_by_model = {groups[0]: {}}
    assert maps_keyed_by_group(store) == ["_held_by_model"]


def test_a_model_reaches_its_own_group_and_never_another_models_records():
    from zinf_compiler.api import store_of

    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    views = [store_of(model) for model in models]  # (claimed now, as a load before the compile claims)
    assert views[0].group is not views[1].group and views[0].groups == (views[0].group,)
    for model, view in zip(models, views):
        for index, param in enumerate(model.parameters()):
            adopt_in(RUNTIME.store, param, f"p{index}", stage=3, partition="allgather", param_dtype="fp32",
                     param_tier="device", opt_tier="device")
        assert all(RUNTIME.store.lookup(p).group is view.group for p in model.parameters())
    # Each view finds its model's records only: checkpoint code handed one model cannot reach the other's.
    assert all(views[0].lookup(p) is not None for p in models[0].parameters())
    assert all(views[0].lookup(p) is None for p in models[1].parameters())
    assert store_of(models[0]).group is views[0].group  # the same group, asked again
    # A container of both models spans both groups, and finds both.
    both = store_of(torch.nn.ModuleList(models))
    assert both.groups == (views[0].group, views[1].group)
    assert all(both.lookup(p) is not None for model in models for p in model.parameters())
    # Units are the group's own: built once, kept by the model whose parameters they move.
    records = [RUNTIME.store.lookup(p) for p in models[1].parameters()]
    unit = RUNTIME.store.unit(records)
    assert views[1].group.units and unit in views[1].group.units.values() and not any(
        unit is other for other in views[0].group.units.values())


def test_two_groups_with_different_meshes_keep_their_own_records_units_and_figures():
    store = ParamStore(RUNTIME.comm)
    meshes = [RUNTIME.comm.mesh(), MeshComm(RUNTIME.comm)]  # (one rank: two meshes of the same rank, distinct)
    groups, params = [], []
    for index, mesh in enumerate(meshes):
        param = torch.nn.Parameter(torch.randn(8, 8))
        group = store.claim([param])
        record = adopt_in(store, param, f"m{index}.w", stage=3, partition="allgather", param_dtype="fp32", mesh=mesh)
        assert record.group is group and group.mesh is mesh and group.store is store
        groups.append(group)
        params.append(param)
    unit = store.unit([store.lookup(params[1])])
    assert list(groups[1].units.values()) == [unit] and groups[0].units == {}
    assert groups[0].ledger is not groups[1].ledger
    assert groups[0].ledger.resting["device"] == groups[1].ledger.resting["device"] > 0
    # A parameter of the first model cannot be adopted into the second's mesh.
    with pytest.raises(ZinfStoreError, match="already shards over"):
        groups[1].check_mesh(meshes[0], "m0.w")
    del params[1], param, record, unit  # (the loop's names held the second model's parameter too)
    gc.collect()
    store.collect()
    assert groups[1].records == {} and groups[1].units == {}  # its records and units went with its parameter
    assert len(groups[0].records) == 1
