"""In-process unit tests of per-model runtime state and the ranks' agreement (issue 27: a fast tier).

No process group, no compile: the ledger's per-model state (fp16 scale,
collective timeout, budget) and how ledgers merge; the fp16 scaler's policy;
the agreement's fingerprints and its error messages.
"""

from __future__ import annotations

import subprocess
import sys

import torch

from zinf_compiler.runtime import agreement
from zinf_compiler.runtime.ledger import Fp16GradScaler, Ledger, merge_ledgers


class _OneRank:
    """A Comm stand-in at world size 1: the scaler's all-reduce adds nothing."""

    world_size = 1

    def all_reduce_sum(self, tensor, what="", timeout=None):
        return None


def test_each_ledger_has_its_own_scale_and_timeout_and_merging_keeps_the_cautious_ones():
    first, second = Ledger(device_memory_limit=100), Ledger()
    first.collective_timeout, second.collective_timeout = 30, 5
    first.fp16_scaler.scale, second.fp16_scaler.scale = 2.0**10, 2.0**12
    second.fp16_scaler.skipped_steps = 3
    assert first.fp16_scaler is not second.fp16_scaler
    merged = merge_ledgers([first, second])
    assert merged is first and second.root() is first
    assert merged.collective_timeout == 5 and merged.device_memory_limit == 100
    assert merged.fp16_scaler.scale == 2.0**10 and merged.fp16_scaler.skipped_steps == 3
    third = Ledger()  # no timeout of its own: the merged one keeps the set one
    assert merge_ledgers([third, first]).collective_timeout == 5


def test_fp16_scaler_halves_on_overflow_and_grows_after_good_steps():
    scaler = Fp16GradScaler(init_scale=8.0, growth_interval=2)
    scaler.check(torch.tensor([1.0, float("inf")]))
    assert scaler.should_skip_step(_OneRank(), torch.device("cpu")) and scaler.scale == 4.0
    scaler.check(torch.tensor([1.0]))
    assert not scaler.should_skip_step(_OneRank(), torch.device("cpu"))
    assert not scaler.should_skip_step(_OneRank(), torch.device("cpu")) and scaler.scale == 8.0
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
