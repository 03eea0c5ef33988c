"""In-process unit tests of per-model runtime state and the ranks' agreement (issue 27: a fast tier).

No process group, no compile: model groups (claims, their own scale, timeout,
budget and mesh; groups never merge); the fp16 scaler's policy, alone and for
several groups under one optimizer;
the agreement's fingerprints and its error messages.
"""

from __future__ import annotations

import subprocess
import sys

import torch

from adopting import adopt_in

from zinf_compiler.runtime import agreement
import types

import pytest

from zinf_compiler.api import RUNTIME
from zinf_compiler.runtime.ledger import ZinfStoreError
from zinf_compiler.runtime.model_group import Fp16GradScaler, agree_on_skip, combined_scaler_state
from zinf_compiler.runtime.store import ParamStore


class _OneRank:
    """A Comm stand-in at world size 1: the scaler's all-reduce adds nothing."""

    world_size = 1

    def all_reduce_sum(self, tensor, what="", timeout=None):
        return None


def _params(count: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(4, 2)) for _ in range(count)]


def test_a_claim_makes_one_group_and_later_claims_join_it_without_merging_groups():
    store = ParamStore(RUNTIME.comm)
    first, second, third = _params(2), _params(2), _params(1)
    model_a = store.claim(first, device_memory_limit=100, collective_timeout=30)
    assert store.groups_of(first) == [model_a] and model_a.collective_timeout == 30
    assert model_a.device_memory_limit == 100 and model_a.ledger.device_memory_limit == 100
    model_b = store.claim(second)
    assert model_b is not model_a and model_b.fp16_scaler is not model_a.fp16_scaler
    # A claim over parts of two models: the unclaimed parameter joins the first's; nothing merges.
    assert store.claim([second[0], first[0], third[0]]) is model_b
    assert store.group_of(third[0]) is model_b and store.group_of(first[1]) is model_a
    assert store.groups_of(first + second + third) == [model_a, model_b]
    # Reading claims nothing: a parameter in no group stays in none.
    loose = _params(1)
    assert store.groups_of(loose) == [] and store.group_of(loose[0]) is None


def test_adoption_keeps_the_claimed_group_and_its_mesh():
    store = ParamStore(RUNTIME.comm)
    params = _params(2)
    group = store.claim(params)
    records = [adopt_in(store, param, f"w{i}", stage=3, partition="shard", param_dtype="fp32")
               for i, param in enumerate(params)]
    assert all(record.group is group for record in records)
    assert list(group.records.values()) == records and group.mesh is records[0].mesh
    # A parameter adopted with no claim gets a group of its own.
    loose = adopt_in(store, _params(1)[0], "loose", stage=3, partition="shard", param_dtype="fp32")
    assert loose.group is not group and loose.group.records == {loose.uid: loose}


def test_a_model_adopted_over_another_mesh_is_refused_by_name():
    store = ParamStore(RUNTIME.comm)
    params = _params(2)
    group = store.claim(params)
    adopt_in(store, params[0], "w0", stage=3, partition="shard", param_dtype="fp32")
    other_mesh = types.SimpleNamespace(describe=lambda: "another mesh")
    with pytest.raises(ZinfStoreError, match="w1 is asked to shard over another mesh"):
        group.check_mesh(other_mesh, "w1")


def test_one_optimizer_over_several_groups_skips_all_or_none_and_keeps_their_scales_in_step():
    scalers = [Fp16GradScaler(init_scale=8.0, growth_interval=2) for _ in range(2)]
    scalers[1].check(torch.tensor([1.0, float("inf")]))  # only the second model overflowed
    assert agree_on_skip(scalers, _OneRank(), torch.device("cpu"))
    assert [s.state() for s in scalers] == [{"scale": 4.0, "good_steps": 0, "skipped_steps": 1}] * 2
    assert not any(s.found_inf for s in scalers)
    assert not agree_on_skip(scalers, _OneRank(), torch.device("cpu"))
    scalers[0].scale = 2.0  # (differing scales: a checkpoint keeps the most cautious figures)
    assert combined_scaler_state(scalers) == {"scale": 2.0, "good_steps": 1, "skipped_steps": 1}


def test_fp16_scaler_halves_on_overflow_and_grows_after_good_steps():
    scaler = Fp16GradScaler(init_scale=8.0, growth_interval=2)
    scaler.check(torch.tensor([1.0, float("inf")]))
    assert agree_on_skip([scaler], _OneRank(), torch.device("cpu")) and scaler.scale == 4.0
    scaler.check(torch.tensor([1.0]))
    assert not agree_on_skip([scaler], _OneRank(), torch.device("cpu"))
    assert not agree_on_skip([scaler], _OneRank(), torch.device("cpu")) and scaler.scale == 8.0
    restored = Fp16GradScaler()
    restored.load_state(scaler.state())
    assert restored.state() == {"scale": 8.0, "good_steps": 2, "skipped_steps": 1}


def test_fingerprints_are_equal_across_processes_and_differ_with_their_parts():
    parts = ([("param", "blocks.0.fc.weight"), ("buffer", "blocks.0.scale")], {"stage": 3})
    here = agreement.fingerprint(*parts)
    there = subprocess.run([sys.executable, "-c", "from zinf_compiler.runtime import agreement; "
                            f"print(agreement.fingerprint(*{parts!r}))"], capture_output=True, text=True, timeout=60)
    assert int(there.stdout) == here  # no per-process hash seed
    assert agreement.fingerprint(parts[0], {"stage": 2}) != here
    assert 0 <= here < 2**63  # fits a signed int64 tensor


def test_the_mismatch_message_names_the_option_or_parameter_and_each_ranks_value():
    rows = [[agreement.COMPILE, 7, 1], [agreement.COMPILE, 7, 2]]
    sides = [{"doing": agreement.COMPILE, "graph": "graph 0 (parameters a.weight)",
              "options": {"stage": 3, "bucket_bytes": 0}, "params": {"a.weight": [4, 2]}},
             {"doing": agreement.COMPILE, "graph": "graph 0 (parameters a.weight)",
              "options": {"stage": 2, "bucket_bytes": 0}, "params": {"a.weight": [8, 2]}}]
    message = agreement._explain(sides, rows)
    assert "option 'stage': rank 0 has 3, rank 1 has 2" in message
    assert "parameter a.weight: rank 0 has shape (4, 2), rank 1 has shape (8, 2)" in message
    assert "bucket_bytes" not in message
    rows[1] = [agreement.FORWARD, 9, 2]
    sides[1] = {**sides[1], "doing": agreement.FORWARD, "graph": "graph 3 (parameters b.weight)"}
    message = agreement._explain(sides, rows)
    assert "ranks are about to run different graphs" in message
    assert "rank 0: compiling graph 0" in message and "rank 1: the forward of graph 3" in message


def test_agreement_at_world_size_one_exchanges_nothing():
    class NoCollectives(_OneRank):
        def all_gather_rows(self, *args, **kwargs):
            raise AssertionError("no exchange at world size 1")

    agreement.check(NoCollectives(), agreement.FORWARD, 1, 2, lambda: {})
