"""Issue 25 point 5: one name for a parameter's or a node's module, and one rule for what a block is.

``unit_plan.py`` buckets parameters per block (from their names) and
``recompute.py`` checkpoints per block (from the nodes' ``nn_module_stack``);
both read :mod:`zinf_compiler.module_paths`.  A model whose forward is
reached through ``def wrapper(*args, **kwargs)`` (transformers'
``@can_return_tuple``) is ``L['args'][0]`` to Dynamo, which once made the
whole model one block ``.0``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from zinf_compiler import module_paths, recompute
from zinf_compiler.module_paths import ModuleBlocks, module_path, module_path_from_source, repeated_blocks
from usage import Pair, seeded


@pytest.mark.parametrize("spelling,expected", [
    ("L['self'].layers.3", "layers.3"),
    ("L['self'].layers.3.mlp.fc1", "layers.3.mlp.fc1"),
    ("L['args'][0].model.layers.0", "model.layers.0"),
    ("L['args'][0].model.layers.0.self_attn", "model.layers.0.self_attn"),
    ("L['kwargs']['model'].blocks.1.attn", "blocks.1.attn"),
    ("G['model'].h.2", "h.2"),
    ("getattr(L['self'].blocks, '3')", "blocks.3"),
    ("getattr(L['self'].blocks, '3').mlp", "blocks.3.mlp"),
    ("getattr(getattr(L['args'][0].model.layers, '1').mlp, '0')", "model.layers.1.mlp.0"),
    ("L['self'].blocks[3]", "blocks.3"),
    ("L['self'].blocks[3].mlp", "blocks.3.mlp"),
    ("L['self'].heads['first']", "heads.first"),
    ("L['self']._modules['layers']._modules['0']._parameters['weight']", "layers.0.weight"),
    ("L['args'][0]._modules['model']._modules['layers']._modules['1']._modules['mlp']", "model.layers.1.mlp"),
    ("L['self']", ""),
    ("L['args'][0]", ""),
    ("layers.0.mlp", "layers.0.mlp"),  # already a path (torch.export's spelling)
])
def test_module_path_of_every_dynamo_spelling(spelling, expected):
    assert module_path(spelling) == expected


def test_module_path_strips_the_graphs_own_roots():
    """A root that is itself indexed (``seq[0]`` of a compiled function's argument) keeps its index."""
    roots = ("L['seq']",)
    assert module_path("L['seq'][0]", roots) == "0"
    assert module_path("L['seq'][1].fc", roots) == "1.fc"
    # A non-module object holding the model: the root is what the parameters' sources start from.
    assert module_path("L['self'].model.layers.2", ("L['self'].model",)) == "layers.2"


def test_parameter_names_from_sources():
    source = "L['args'][0]._modules['model']._modules['layers']._modules['0']._modules['q']._parameters['weight']"
    assert module_path_from_source(source) == "model.layers.0.q.weight"
    assert module_path_from_source("L['self']._buffers['mask']") == "mask"
    assert module_path_from_source("L['args'][1]") == "L['args'][1]"  # a user input keeps its source


LINEAR, RELU, LAYER = "torch.nn.Linear", "torch.nn.ReLU", "Layer"


@pytest.mark.parametrize("classes,blocks", [
    # A list of repeated layers.
    ({"layers": "ModuleList", "layers.0": LAYER, "layers.0.fc": LINEAR, "layers.1": LAYER, "layers.1.fc": LINEAR},
     {"layers.0", "layers.1"}),
    # A Sequential of mixed layers: classifier.0 and classifier.2 are Linear, yet not blocks.
    ({"classifier": "Sequential", "classifier.0": LINEAR, "classifier.1": RELU, "classifier.2": LINEAR}, set()),
    # Weight norm's parametrization chain.
    ({"wn": "ParametrizedLinear", "wn.parametrizations.weight": "torch.nn.utils.parametrize.ParametrizationList",
      "wn.parametrizations.weight.0": "torch.nn.utils.parametrizations._WeightNorm"}, set()),
    # Two parametrizations of one kind are still not layers.
    ({"wn.parametrizations.weight": "torch.nn.utils.parametrize.ParametrizationList",
      "wn.parametrizations.weight.0": "Orth", "wn.parametrizations.weight.1": "Orth"}, set()),
    # Repeated layers and a final norm in one Sequential.
    ({"seq.0": LAYER, "seq.0.fc": LINEAR, "seq.1": LAYER, "seq.1.fc": LINEAR, "seq.2": "LayerNorm"},
     {"seq.0", "seq.1"}),
    # A list of identical leaves (per-head projections).
    ({"heads.0": LINEAR, "heads.1": LINEAR, "heads.2": LINEAR}, {"heads.0", "heads.1", "heads.2"}),
    # One layer in its list (a 1-layer model, or the one layer a graph break leaves in a graph).
    ({"layers.0": LAYER, "layers.0.fc": LINEAR}, {"layers.0"}),
    # A single leaf in a container is no block.
    ({"head.0": LINEAR}, set()),
    # Experts inside layers: both levels are repeated.
    ({"layers.0": LAYER, "layers.0.experts.0": LINEAR, "layers.0.experts.1": LINEAR,
      "layers.1": LAYER, "layers.1.experts.0": LINEAR, "layers.1.experts.1": LINEAR},
     {"layers.0", "layers.1", "layers.0.experts.0", "layers.0.experts.1", "layers.1.experts.0", "layers.1.experts.1"}),
])
def test_repeated_blocks(classes, blocks):
    assert repeated_blocks(classes) == blocks


def test_block_of_takes_the_outermost_block():
    blocks = ModuleBlocks(roots=(), blocks=frozenset({"layers.0", "layers.0.experts.1", "classifier"}))
    assert blocks.block_of("layers.0.experts.1.w") == "layers.0"
    assert blocks.block_of("layers.0") == "layers.0"
    assert blocks.block_of("layers.10.fc.weight") is None  # not layers.1
    assert blocks.block_of("classifier.0.weight") == "classifier"
    assert blocks.block_of("embed.weight") is None
    assert blocks.block_of("") is None


def test_unknown_graph_has_no_blocks():
    """A CapturedGraph built without a Dynamo graph (the dump tests build one) tags and buckets no block."""
    assert ModuleBlocks().block_of("layers.0.fc.weight") is None


# ----- end to end: a forward reached through def wrapper(*args, **kwargs) -----

def _wrapped(forward):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):  # what transformers' @can_return_tuple does
        return forward(*args, **kwargs)
    return wrapper


class Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class WrappedModel(torch.nn.Module):
    """Repeated layers, a Sequential head of mixed layers and a weight-normed projection."""

    def __init__(self, width: int = 16, layers: int = 3, by_getattr: bool = False):
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.layers = torch.nn.ModuleList([Layer(width) for _ in range(layers)])
        self.proj = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(width, width))
        self.classifier = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
        self.by_getattr = by_getattr

    @_wrapped
    def forward(self, x):
        x = self.embed(x)
        if self.by_getattr:  # Dynamo spells these getattr(L['args'][0].layers, '1')
            for index in range(len(self.layers)):
                x = getattr(self.layers, str(index))(x)
        else:
            for layer in self.layers:
                x = layer(x)
        return self.classifier(self.proj(x))


EXPECTED_BLOCKS = {"layers.0", "layers.1", "layers.2"}


def test_blocks_from_the_module_tree_equal_the_graphs():
    """What the Dynamo graph records (paths and classes in nn_module_stack, parameter sources) gives the
    blocks the module tree gives."""
    model = WrappedModel()
    assert repeated_blocks(module_paths.module_classes(model)) == EXPECTED_BLOCKS
    seen = []

    def backend(gm, example_inputs):
        seen.append(ModuleBlocks.from_graph(gm))
        return gm

    torch.compile(model, backend=backend)(torch.randn(2, 8))
    (blocks,) = seen
    assert blocks.roots == ("L['args'][0]",)
    assert blocks.blocks == EXPECTED_BLOCKS
    assert blocks.block_of("layers.1.fc2.weight") == "layers.1"
    for name in ("classifier.0.weight", "classifier.2.bias", "proj.parametrizations.weight.original0", "embed.weight"):
        assert blocks.block_of(name) is None, name


@pytest.fixture
def activation_plans(monkeypatch):
    """Every checkpointing plan recompute.py decides, in order."""
    plans = []
    original = recompute.apply_policy

    def recording(graph, captured):
        original(graph, captured)
        plans.append(captured.activation_plan)

    monkeypatch.setattr(recompute, "apply_policy", recording)
    return plans


@pytest.mark.parametrize("by_getattr", [False, True], ids=["iterated", "getattr"])
def test_wrapped_forward_checkpoints_one_region_per_layer(by_getattr, activation_plans):
    """Acceptance: a forward behind ``def wrapper(*args, **kwargs)`` gets one recompute region per layer
    (not one ``.0`` for the whole model), the head and weight norm are no blocks, and training equals eager."""
    options = {"stage": 3, "lower": "eager", "activation_checkpointing": "block"}
    pair = Pair(seeded(lambda: WrappedModel(by_getattr=by_getattr), 0), options, lr=1e-2, optimizer="AdamW", eps=1e-6)
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    losses = [pair.step(batch) for batch in batches]
    pair.assert_equal(losses, f"wrapped model (by_getattr={by_getattr})")
    assert activation_plans, "no checkpointing plan was made"
    for plan in activation_plans:
        assert set(plan["blocks"]) == EXPECTED_BLOCKS, plan
        # Every layer's nodes are tagged, none twice.
        assert all(count > 0 for count in plan["blocks"].values()), plan
