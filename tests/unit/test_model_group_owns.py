"""What belongs to one model lives in its ModelGroup (runtime/model_group.py), not in a map of the process-wide
ParamStore keyed by group: the values and gradients a pipeline step holds are the group's own."""

import weakref

import torch

from adopting import adopt_in

from zinf_compiler.api import RUNTIME
from zinf_compiler.runtime.model_group import ModelGroup
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
