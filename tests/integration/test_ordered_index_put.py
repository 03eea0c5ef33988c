"""The embedding's backward gives the same bits every time under Inductor (zinf_compiler/ordered_index_put.py).

Found running the README's example twice (2026-11-27): the losses parted from the second step, for every
offload and stage under Inductor, because ATen's accumulating index_put on the CPU adds across threads in
whatever order they come unless deterministic algorithms are on *when it runs*; zinf had them on only while
lowering.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import zinf_compiler  # noqa: F401  (registers the backend and its ops)
from zinf_compiler import lowering, ordered_index_put

VOCAB, WIDTH, TOKENS = 64, 256, 8192  # many tokens per row: the adds collide on every row


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, tokens, scale):
        # Each token's row gets its own gradient (scaled): equal addends would sum alike in any order.
        return self.head(self.embed(tokens) * scale).square().mean()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (TOKENS,), generator=generator), torch.rand(TOKENS, 1, generator=generator)


# zinf's ordered ops by name, and the Python function each runs: called directly (not through the dispatcher,
# where the recorder would meet the op again) so that the recorder sees the ATen call inside.
ORDERED_OPS = {"zinf::index_put_in_order": ordered_index_put.index_put_in_order._init_fn,
               "zinf::index_put_in_order_on_zeros": ordered_index_put.index_put_in_order_on_zeros._init_fn}


class IndexPutsRun(TorchDispatchMode):
    """Records the accumulating index_puts that run inside it, zinf's ordered ops and the ATen calls inside
    them included, each with whether deterministic algorithms were on at that moment: ATen's CPU kernel adds
    in order only if they are (it reads the flag when it runs, not when the graph was lowered)."""

    def __init__(self, runs: list | None = None) -> None:
        super().__init__()
        self.runs: list[tuple[str, bool]] = [] if runs is None else runs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if name in ORDERED_OPS or name == "aten::_unsafe_masked_index_put_accumulate" or (
                name in ("aten::index_put", "aten::index_put_", "aten::_index_put_impl_")
                and (args[3] if len(args) > 3 else kwargs.get("accumulate", False))):
            self.runs.append((name, torch.are_deterministic_algorithms_enabled()))
        if name in ORDERED_OPS:
            with IndexPutsRun(self.runs):  # (this one is off while it handles the call)
                return ORDERED_OPS[name](*args, **kwargs)
        return func(*args, **kwargs)


def embedding_grads(repeats: int, runs: list | None = None) -> list[torch.Tensor]:
    """The embedding's gradient after each of ``repeats`` steps; ``runs`` gets each backward's index_puts."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Embedder()
    compiled = torch.compile(model, backend="zinf", options={"stage": 0})  # the default lowering: Inductor
    tokens, scale = inputs()
    grads = []
    for _ in range(repeats):
        loss = compiled(tokens, scale)
        recorder = IndexPutsRun()
        with recorder:  # the backward graph alone: the forward is Dynamo's, which a mode would make retrace
            loss.backward()
        if runs is not None:
            runs.append(recorder.runs)
        grads.append(model.embed.weight.grad.clone())
        model.zero_grad()
    return grads


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_the_embeddings_gradient_is_the_same_bits_every_step_under_inductor(two_threads):
    runs = []
    grads = embedding_grads(12, runs)
    # What makes it so, whether or not ATen's threads would have raced this time: every step's backward adds
    # through zinf's ordered op, inside which ATen's accumulating index_put runs with deterministic algorithms
    # on, and the user's setting (off) outside it.
    assert runs == [[("zinf::index_put_in_order_on_zeros", False), ("aten::index_put_", True)]] * 12
    assert all(torch.equal(grads[0], grad) for grad in grads[1:])
    # It is the sum it should be, and the user's flag is theirs again after the graph ran.
    torch.manual_seed(0)
    reference = Embedder()
    reference(*inputs()).backward()
    torch.testing.assert_close(grads[0], reference.embed.weight.grad, rtol=1e-5, atol=1e-6)
    assert not torch.are_deterministic_algorithms_enabled()


def test_the_embeddings_backward_adds_into_new_zeros_without_copying_them(monkeypatch):
    """Its target is a fresh zero tensor the weight's size: the op makes it and adds into it in place (the
    functional op would copy a vocabulary's worth of gradient once more a step)."""
    rewritten = []

    def spy(aten_gm):
        replaced = ordered_index_put.order_accumulating_index_puts(aten_gm)
        rewritten.extend(node.target for node in aten_gm.graph.nodes if node.op == "call_function")
        return replaced

    monkeypatch.setattr(lowering, "order_accumulating_index_puts", spy)
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        grads = embedding_grads(2)
    assert torch.ops.zinf.index_put_in_order_on_zeros.default in rewritten
    assert torch.ops.zinf.index_put_in_order.default not in rewritten
    assert torch.equal(grads[0], grads[1])


def test_without_the_ordered_op_atens_index_put_runs_with_deterministic_algorithms_off(monkeypatch):
    """The first test's check of what runs can fail, whatever the threads do: with the graph's index_puts left
    as ATen's, the backward runs ATen's accumulating index_put with the flag off, the kernel that adds across
    threads in any order (the next test sees the order change)."""
    monkeypatch.setattr(lowering, "order_accumulating_index_puts", lambda aten_gm: 0)
    runs = []
    # Compiled afresh: a cached graph of the test above would hold the ordered op.
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        embedding_grads(1, runs)
    assert runs == [[("aten::index_put_", False)]]


# In --all only: it needs ATen's two threads to race within a dozen steps, which on a loaded machine (or one
# core) they may not do, with no bug. The default run has the check above, which does not depend on timing.
@pytest.mark.slow
def test_without_the_ordered_op_the_adds_come_in_any_order(two_threads, monkeypatch):
    """The first test's bit equality can fail: with the graph's index_puts left as ATen's, the same step's
    gradient differs in its last bits within a dozen steps (if this ever passes by chance, the machine has one
    core or was too busy for the threads to overlap)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the adds cannot race")
    monkeypatch.setattr(lowering, "order_accumulating_index_puts", lambda aten_gm: 0)
    # Compiled afresh: a cached graph of the test above would hold the ordered op.
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        grads = embedding_grads(12)
    assert not all(torch.equal(grads[0], grad) for grad in grads[1:])


def test_the_ordered_op_equals_atens_and_keeps_the_users_flag():
    target = torch.randn(VOCAB, 8)
    rows = torch.randint(0, VOCAB, (500,), generator=torch.Generator().manual_seed(2))
    values = torch.randn(500, 8)
    expected = target.index_put([rows], values, accumulate=True)
    torch.testing.assert_close(torch.ops.zinf.index_put_in_order(target, [rows], values), expected)
    mask = rows % 2 == 0
    masked = torch.ops.zinf.index_put_in_order(target, [rows], values, mask.unsqueeze(1))
    torch.testing.assert_close(masked, target.index_put([rows[mask]], values[mask], accumulate=True))
    # Into zeros of its own: the same bits as ATen's on a zero target (small enough to add serially there),
    # masked-out indices out of range included (ATen clamps them).
    zeros = torch.zeros(VOCAB, 8)
    on_zeros = torch.ops.zinf.index_put_in_order_on_zeros
    assert torch.equal(on_zeros([VOCAB, 8], torch.float32, torch.device("cpu"), [rows], values),
                       zeros.index_put([rows], values, accumulate=True))
    wild = torch.where(mask, rows, VOCAB + 5)
    assert torch.equal(on_zeros([VOCAB, 8], torch.float32, torch.device("cpu"), [wild], values, mask.unsqueeze(1)),
                       torch.ops.aten._unsafe_masked_index_put_accumulate(zeros, mask.unsqueeze(1), [wild], values))
    assert not torch.are_deterministic_algorithms_enabled()


def test_threads_calling_the_op_at_once_leave_the_users_flag_as_it_was(two_threads):
    # The flag is process-wide: without the op's lock, a thread entering while another is inside reads "on"
    # as the user's setting and restores it on the way out, so the flag stayed on after both were done.
    target, rows, values = torch.zeros(VOCAB, 64), torch.randint(0, VOCAB, (4096,)), torch.randn(4096, 64)
    expected = torch.ops.zinf.index_put_in_order(target, [rows], values)
    results, start = [], threading.Barrier(4)

    def call_many():
        start.wait()
        results.extend(torch.ops.zinf.index_put_in_order(target, [rows], values) for _ in range(50))

    callers = [threading.Thread(target=call_many) for _ in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert not torch.are_deterministic_algorithms_enabled()
    assert len(results) == 200 and all(torch.equal(result, expected) for result in results)
    with ordered_index_put.deterministic_algorithms():  # re-entrant: a lowering may run the op inside it
        with ordered_index_put.deterministic_algorithms():
            assert torch.are_deterministic_algorithms_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
