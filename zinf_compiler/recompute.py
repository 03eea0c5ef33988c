"""Activation checkpointing: which forward values backward recomputes, decided on the joint graph.

AOTAutograd traces forward and backward as one *joint* graph and its min-cut
partitioner splits it, choosing which forward values to save.  zinf does not
write a partitioner of its own: it tags joint-graph nodes with PyTorch's
checkpoint policies (``node.meta["recompute"]``, the tags
``torch.utils.checkpoint`` uses under ``torch.compile``) and sets PyTorch's
activation memory budget, then lets the partitioner cut.  The tags run as
Inductor's ``joint_custom_pre_pass`` (``lower="inductor"``) or right before
the partitioner (``lower="eager"``); see :func:`joint_graph_hook`.

Policies (option ``activation_checkpointing``):

* ``"block"``: every forward node inside a repeated block (``blocks.3``,
  the outermost block of the module Dynamo's ``nn_module_stack`` names:
  ``captured.module_blocks``, which the partition pass buckets by too; see
  zinf_compiler/module_paths.py) is ``MUST_RECOMPUTE``, with one
  ``ac_graph_id`` per block, so the partitioner saves only what enters each
  block (the boundary between two blocks is saved by PyTorch's
  ``cleanup_recompute_tags``).
  Random ops (dropout) are recomputed with the forward's RNG state: the
  partitioner's ``functionalize_rng_ops`` saves it and replays it.
* ``"auto"`` without activation offload: PyTorch's knapsack under
  ``activation_memory_budget`` (a fraction, passed as is; a byte count is
  turned into the fraction of the bytes eager autograd would save, so the
  partitioner never keeps more than the budget).
* ``"auto"`` with ``offload_activations``: PyTorch's budget machinery only
  knows "save or recompute", not a third place to keep a value, so zinf
  chooses per tensor: the values eager autograd would save, largest first,
  leave the device until what stays fits the budget; each is offloaded
  (``MUST_SAVE`` plus ``meta["zinf_offload"]``, read by the ``activations``
  pass) where the cost model finds that cheaper than recomputing it (its
  recompute time against the step time its transfers would add, those that
  compute cannot hide).  What to recompute is left to PyTorch's knapsack,
  whose budget excludes the ``MUST_SAVE`` values, given the budget plus
  the offloaded bytes (tagging the chosen values ``MUST_RECOMPUTE``
  instead made the min-cut save their inputs: more bytes than the knapsack
  keeps).  With a byte budget, the ``activations`` pass then offloads
  whatever the cut still keeps past it.

Stage 3 needs nothing here: parameters enter the joint graph as primals
(storage-less at run time) and the partition pass inserts gathers into the
forward and backward graphs *after* the cut, so a gathered full parameter
or a collective's result is never a saved value (backward gathers again);
``tests/test_activations.py`` checks this on the dumped graphs.

The decisions are recorded on ``captured.activation_plan`` for the dumps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from . import ops
from .context import CapturedGraph
from .graph_utils import nbytes_hint
from .module_paths import ModuleBlocks


def forward_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The joint graph's forward computation: nodes that no tangent (backward input) reaches."""
    backward: set = set()
    for node in graph.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            backward.add(node)
        elif any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    return [node for node in graph.nodes if node.op == "call_function" and node not in backward]


def _nbytes(node: torch.fx.Node) -> int:
    return nbytes_hint(node.meta.get("val"))


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) and target.is_view) or target.__name__ == "getitem"


def saved_by_eager(forward: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """Forward values backward reads, directly or through views (what eager autograd would save)."""
    forward_set = set(forward)
    return [node for node in forward
            if not _is_view(node) and _nbytes(node) > 0
            and any(user not in forward_set and user.op != "output"
                    for read in (node, *_views_of(node)) for user in read.users)]


def _views_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    views, frontier = [], [node]
    while frontier:
        for user in frontier.pop().users:
            if user.op == "call_function" and _is_view(user) and user not in views:
                views.append(user)
                frontier.append(user)
    return views


def tag_blocks(graph: torch.fx.Graph, module_blocks: ModuleBlocks) -> dict[str, int]:
    """``"block"``: recompute every forward node inside a repeated block.  Returns block -> nodes tagged."""
    ids: dict[str, int] = {}
    counts: dict[str, int] = {}
    for node in forward_nodes(graph):
        block = module_blocks.block_of_node(node)
        if block is None:
            continue
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = ids.setdefault(block, len(ids))
        counts[block] = counts.get(block, 0) + 1
    return counts


def tag_random_ops(graph: torch.fx.Graph) -> int:
    """``"auto"``: every random forward op (dropout's ``rand``) is ``MUST_RECOMPUTE``.  Returns how many.

    PyTorch's knapsack may choose to recompute a random op it first banned
    ("random op"), but replays the forward's RNG state
    (``functionalize_rng_ops``) only when some op is tagged: without this a
    dropout recomputed in backward drew a fresh mask, and gradients came out
    wrong (found by ``test_dropout_masks_are_recomputed_exactly``).  Tagged,
    the partitioner saves the RNG seed and offset and replays them; the mask
    itself is never saved.
    """
    count = 0
    for node in forward_nodes(graph):
        if _draws_random_numbers(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = 0
            count += 1
    return count


def _draws_random_numbers(node: torch.fx.Node) -> bool:
    """A random op, or attention with dropout (attention is tagged seeded for its dropout_p alone)."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    if any(argument.name == "dropout_p" for argument in target._schema.arguments):
        dropout = ops.arg(node, "dropout_p")
        return not (isinstance(dropout, (int, float)) and dropout == 0)
    return True


def budget_fraction(budget: float | int, eager_bytes: int) -> float:
    """PyTorch's budget fraction for ``activation_memory_budget`` (a fraction, or bytes of ``eager_bytes``)."""
    if isinstance(budget, float):
        return budget
    return min(1.0, budget / eager_bytes) if eager_bytes else 1.0


class _ExposedTransfers:
    """The step time offloads add: what their transfers cannot hide behind compute.

    On an accelerator an offload's transfers run beside compute: the copy
    off the device and the NVMe write during forward, the read and the copy
    back during backward (prefetched by the schedule).  Each channel (the
    disk's write and read side, the host-device link each way) hides up to
    the compute time of its phase; past that the step waits for it.  On a
    CPU device nothing hides: the staging copies, the checksums and the I/O
    threads run on the cores that compute (measured with
    ``benchmarks/activations.py`` on 2 cores: an NVMe offload cost more step
    time than its disk time alone).  Recomputing always adds its compute to
    backward.
    """

    BACKWARD_PER_FORWARD = 2.0  # backward's compute, in forwards: the window reads hide behind

    def __init__(self, cost_model, tier: str, forward_seconds: float):
        self.cost_model = cost_model
        on_cpu = getattr(getattr(cost_model, "profile", None), "device", "cpu") == "cpu"
        backward_seconds = self.BACKWARD_PER_FORWARD * forward_seconds
        # channel -> (transfer step, window it hides behind; None: never hidden)
        self.channels = {"copy out": ("cg", None if on_cpu else forward_seconds),
                         "copy back": ("cg", None if on_cpu else backward_seconds)}
        if tier == "nvme":
            self.channels.update({"write": ("write", None if on_cpu else forward_seconds),
                                  "read": ("nc", None if on_cpu else backward_seconds)})
        self.used = {channel: 0.0 for channel in self.channels}

    def _added(self, nbytes: int) -> dict[str, float]:
        added = {}
        for channel, (step, window) in self.channels.items():
            seconds = self.cost_model.transfer_seconds(step, nbytes)
            if window is None:
                added[channel] = seconds
            else:
                used = self.used[channel]
                added[channel] = max(0.0, used + seconds - window) - max(0.0, used - window)
        return added

    def seconds(self, nbytes: int) -> float:
        """The step time offloading ``nbytes`` more would add."""
        return sum(self._added(nbytes).values())

    def take(self, nbytes: int) -> None:
        for channel, (step, _) in self.channels.items():
            self.used[channel] += self.cost_model.transfer_seconds(step, nbytes)


def choose_per_tensor(saved: list[torch.fx.Node], budget_bytes: int, cost_model, tier: str,
                      min_bytes: int, forward_seconds: float = 0.0) -> list[dict[str, Any]]:
    """``"auto"`` with offload: recompute or offload the largest saved values until the rest fits the budget.

    A value is recomputed when its compute costs less than the step time its
    offload would add (:class:`_ExposedTransfers`: transfers hide behind
    ``forward_seconds`` of forward compute and twice that of backward).
    """
    decisions = []
    remaining = sum(_nbytes(node) for node in saved)
    exposed = _ExposedTransfers(cost_model, tier, forward_seconds)
    for node in sorted(saved, key=_nbytes, reverse=True):
        nbytes = _nbytes(node)
        if remaining <= budget_bytes or nbytes < min_bytes:
            break
        recompute_s = cost_model.node_seconds(node)
        offload_s = exposed.seconds(nbytes)
        choice = "recompute" if recompute_s < offload_s else "offload"
        if choice == "offload":
            exposed.take(nbytes)
        # Backward often reads a view of the value (a reshape before a matmul): the partitioner
        # saves whichever node backward reads, so the choice holds for the value's views too.
        # A value to recompute is left to the knapsack (see the module docstring).
        for tagged in [node, *_views_of(node)] if choice == "offload" else []:
            tagged.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            tagged.meta["zinf_offload"] = True
        remaining -= nbytes
        decisions.append({"node": node.name, "bytes": nbytes, "choice": choice,
                          "recompute_ms": recompute_s * 1e3, "offload_ms": offload_s * 1e3})
    return decisions


def apply_policy(graph: torch.fx.Graph, captured: CapturedGraph) -> None:
    """Tag ``graph`` (a joint graph) for the options' checkpointing policy; record what was decided."""
    options = captured.options
    policy = options.activation_checkpointing
    plan: dict[str, Any] = {"policy": policy, "offload": options.offload_activations}
    if policy == "block":
        plan["blocks"] = tag_blocks(graph, captured.module_blocks)
    elif policy == "auto":
        plan["random_ops_replayed"] = tag_random_ops(graph)
        saved = saved_by_eager(forward_nodes(graph))
        eager_bytes = sum(_nbytes(node) for node in saved)
        fraction = budget_fraction(options.activation_memory_budget, eager_bytes)
        plan.update(eager_saved_bytes=eager_bytes, budget_fraction=fraction)
        if options.offload_activations == "none":
            # PyTorch's knapsack reads a float budget off the first node that carries one.
            first = next(iter(graph.nodes))
            first.meta["memory_budget"] = float(fraction)
        else:
            budget_bytes = int(fraction * eager_bytes)
            plan["budget_bytes"] = budget_bytes
            if isinstance(options.activation_memory_budget, int):
                # A byte budget is a promise about bytes: the activations pass offloads what the
                # cut keeps past it.  A fraction is PyTorch's (of what the default partition
                # saves), the same for the knapsack with and without offload.
                plan["enforced_bytes"] = options.activation_memory_budget
            forward_seconds = sum(captured.cost_model.node_seconds(node) for node in forward_nodes(graph))
            plan["forward_ms"] = forward_seconds * 1e3
            plan["decisions"] = choose_per_tensor(saved, budget_bytes, captured.cost_model,
                                                  options.offload_activations, options.activation_offload_min_bytes,
                                                  forward_seconds)
            offloaded = sum(d["bytes"] for d in plan["decisions"] if d["choice"] == "offload")
            knapsack = min(1.0, (budget_bytes + offloaded) / eager_bytes) if eager_bytes else 1.0
            plan["knapsack_fraction"] = knapsack
            next(iter(graph.nodes)).meta["memory_budget"] = float(knapsack)
    captured.activation_plan = plan


def joint_graph_hook(captured: CapturedGraph):
    """The pre-partition step for ``captured``'s joint graph (None when the policy is "none" with no offload)."""
    if captured.options.activation_checkpointing == "none":
        return None

    def hook(graph: torch.fx.Graph) -> None:
        apply_policy(graph, captured)

    return hook
