"""Module paths and blocks: one name for a module however Dynamo spells it, one rule for what a block is.

Dynamo names a module by how the compiled frame reaches it: ``L['self']``
for a module's own ``forward``, ``L['args'][0]`` when the forward is reached
through ``def wrapper(*args, **kwargs)`` (transformers' ``@can_return_tuple``
and ``check_model_inputs``), ``L['kwargs']['model']`` or ``G['model']`` for a
compiled function's argument or global, ``getattr(L['self'].blocks, '3')``
for ``getattr(module, name)``, and ``L['self']._modules['blocks']._modules['3']``
in a parameter's source.  :func:`module_path` turns every spelling into the
dotted path ``named_modules()`` gives (``blocks.3``), relative to the
compiled module.

A *block* is a repeated layer: a numbered child of a container whose
numbered children repeat its class (``model.layers.3``, ``h.0``,
``blocks.3``).  Numbered parts that are not repeated layers are no blocks:
``classifier.0`` in ``Sequential(Linear, ReLU, Linear)`` and weight norm's
``parametrizations.weight.0``.  :func:`repeated_blocks` decides this from a
module tree (path -> class).

The backend never receives the module, only Dynamo's graph; but every node
of it records the path and class of each module it runs in
(``nn_module_stack``) and every parameter placeholder its source.
:meth:`ModuleBlocks.from_graph` reads that tree once at capture time
(``CapturedGraph.module_blocks``); the partition pass's buckets
(``unit_plan.py``, from parameter names) and the ``"block"`` checkpointing
regions (``recompute.py``, from ``nn_module_stack``) both ask it, so the two
agree on every block.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from typing import Iterable, Mapping

import torch

# `getattr(X, 'name')` with no call inside X (the innermost one first).
_GETATTR = re.compile(r"getattr\(([^()]*), '([^']*)'\)")
# `._modules['l1']`, `._parameters['weight']`, `._buffers['mask']` -> `.l1`
_STATE_DICT_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")
_FIRST_STATE_DICT_PART = re.compile(r"\._(?:modules|parameters|buffers)\[")
# Without known roots: `L['self']`, `G['model']`, and the element of varargs: `L['args'][0]`, `L['kwargs']['m']`.
_DEFAULT_ROOT = re.compile(r"^[LG]\[(?:'(?:args|kwargs)'\]\[[^\]]*\]|[^\]]*\])")
_INDEX = re.compile(r"\[(\d+)\]")  # blocks[3]
_KEY = re.compile(r"\['([^']*)'\]")  # ModuleDict: heads['first']

# A parametrization chain (``parametrizations.weight.0``) is part of its module, never a repeated layer.
_PARAMETRIZATION_LIST = "torch.nn.utils.parametrize.ParametrizationList"


def _spelled_as_attributes(spelling: str) -> str:
    """``getattr(X, 'a')`` and ``X._modules['a']`` as ``X.a``."""
    while True:
        rewritten = _GETATTR.sub(r"\1.\2", spelling)
        if rewritten == spelling:
            break
        spelling = rewritten
    return _STATE_DICT_PART.sub(r".\1", spelling)


def module_path(spelling: str, roots: Iterable[str] = ()) -> str:
    """The dotted path of the module (or parameter) Dynamo spells ``spelling``, relative to its root.

    ``roots`` are the graph's own spellings of the compiled modules (see
    :func:`root_of_source`); the longest one ``spelling`` starts with is
    removed.  Without one, the first subscript of ``L``/``G`` is (and the
    element of ``args``/``kwargs``).  A path with no root (``layers.0``)
    is returned as it is.
    """
    return _module_path(spelling, tuple(roots))


@functools.lru_cache(maxsize=1 << 16)  # every node of a graph asks for its stack's few spellings
def _module_path(spelling: str, roots: tuple[str, ...]) -> str:
    spelling = _spelled_as_attributes(spelling)
    for root in sorted((_spelled_as_attributes(root) for root in roots), key=len, reverse=True):
        if spelling == root or spelling.startswith((root + ".", root + "[")):
            spelling = spelling[len(root):]
            break
    else:
        spelling = _DEFAULT_ROOT.sub("", spelling)
    spelling = _KEY.sub(r".\1", _INDEX.sub(r".\1", spelling))
    return spelling.strip(".")


def root_of_source(source_name: str) -> str | None:
    """The compiled module's spelling in a parameter's or buffer's source: what precedes its first
    ``._modules[``/``._parameters[``/``._buffers[`` (``L['args'][0]``); None for other sources."""
    match = _FIRST_STATE_DICT_PART.search(source_name)
    return source_name[: match.start()] if match else None


def module_path_from_source(source_name: str) -> str:
    """A parameter's or buffer's name (``blocks.0.attn.qkv.weight``) from its Dynamo source; any other
    source (a user input, ``L['args'][1]``) is returned as it is."""
    root = root_of_source(source_name)
    return module_path(source_name, (root,)) if root is not None else source_name


def class_name(module_class) -> str:
    """``torch.nn.modules.linear.Linear`` for a class; a string (torch.export's spelling) as it is."""
    if isinstance(module_class, type):
        return f"{module_class.__module__}.{module_class.__qualname__}"
    return str(module_class)


def module_classes(module: torch.nn.Module) -> dict[str, str]:
    """Path -> class name of every submodule of ``module`` (the tree :func:`repeated_blocks` reads)."""
    return {path: class_name(type(child)) for path, child in module.named_modules(remove_duplicate=False) if path}


def repeated_blocks(classes: Mapping[str, str | None]) -> frozenset[str]:
    """The paths in ``classes`` (module path -> class name, None where unknown) that are blocks.

    A numbered child ``P.N`` of class C is a block when two of these hold:
    C repeats (at least two numbered children of ``P`` are of class C); the
    numbered children of ``P`` are all of class C (a list of one kind); it
    is a layer (it has submodules).  So a list of repeated layers, even of
    one (a one-layer model, or the one layer a graph break leaves in a
    graph), a list of identical leaves (per-head projections) and repeated
    layers beside others in a Sequential are blocks; a leaf in a Sequential
    of mixed layers (``classifier.0``) is not, nor is a parametrization
    (weight norm's ``parametrizations.weight.0``).
    """
    siblings: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    has_children: set[str] = set()
    for path, module_class in classes.items():
        parent, _, last = path.rpartition(".")
        if last.isdigit():
            siblings[parent][module_class] += 1
        while parent:
            has_children.add(parent)
            parent = parent.rpartition(".")[0]
    blocks = set()
    for path, module_class in classes.items():
        parent, _, last = path.rpartition(".")
        if not last.isdigit() or module_class is None or classes.get(parent) == _PARAMETRIZATION_LIST:
            continue
        kinds = siblings[parent]
        repeated, uniform, layer = kinds[module_class] >= 2, len(kinds) == 1, path in has_children
        if repeated + uniform + layer >= 2:
            blocks.add(path)
    return frozenset(blocks)


@dataclasses.dataclass(frozen=True)
class ModuleBlocks:
    """One graph's module naming and blocks (``CapturedGraph.module_blocks``).

    * ``roots``: Dynamo's spellings of the compiled modules in this graph
      (``L['self']``, ``L['args'][0]``), from the parameters' sources.
    * ``blocks``: the module paths that are blocks (:func:`repeated_blocks`).
    """

    roots: tuple[str, ...] = ()
    blocks: frozenset[str] = frozenset()

    @classmethod
    def from_graph(cls, gm: torch.fx.GraphModule) -> "ModuleBlocks":
        """The module tree a Dynamo graph records: every ``nn_module_stack`` entry's path and class, and the
        modules that hold its parameters and buffers."""
        roots: list[str] = []
        sources: list[str] = []
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            grapharg = node.meta.get("grapharg")
            source = getattr(grapharg, "source", None)
            if source is None:
                continue
            name = source.name() if callable(source.name) else source.name  # older torch: a method
            root = root_of_source(name)
            if root is not None:
                sources.append(name)
                if root not in roots:
                    roots.append(root)
        classes: dict[str, str | None] = {}
        for name in sources:  # the modules holding parameters and buffers (class unknown here)
            parts = module_path(name, roots).split(".")[:-1]
            for depth in range(1, len(parts) + 1):
                classes.setdefault(".".join(parts[:depth]), None)
        for node in gm.graph.nodes:
            for spelling, module_class in (node.meta.get("nn_module_stack") or {}).values():
                path = module_path(str(spelling), roots)
                if path:
                    classes[path] = class_name(module_class)
        return cls(roots=tuple(roots), blocks=repeated_blocks(classes))

    def path(self, spelling: str) -> str:
        """:func:`module_path` with this graph's roots."""
        return module_path(spelling, self.roots)

    def block_of(self, path: str) -> str | None:
        """The outermost block ``path`` (a module's or a parameter's) lies in, or None outside any."""
        parts = path.split(".") if path else []
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if prefix in self.blocks:
                return prefix
        return None

    def block_of_node(self, node: torch.fx.Node) -> str | None:
        """The block a graph node was traced in (its innermost ``nn_module_stack`` module's), or None."""
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return None
        spelling = list(stack.values())[-1][0]
        return self.block_of(self.path(str(spelling)))


# --- a model's own names -------------------------------------------------------


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Accept the module or its ``torch.compile`` wrapper."""
    return getattr(model, "_orig_mod", model)


def names_by_tensor(model: torch.nn.Module) -> dict[int, list[str]]:
    """id(tensor) -> every state-dict name it appears under (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, tensor in unwrap(model).state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    return names
