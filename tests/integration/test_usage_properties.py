"""Property-based: models drawn from a small grammar train under zinf exactly as in eager.

The grammar covers what users do and examples miss: repeated blocks of one
class, graph breaks at any place inside a block, weights shared between
blocks, frozen parts, buffers (read and updated in forward), convolutions,
forwards reached through ``*args`` wrappers (as Hugging Face's decorators
do), gradient hooks, 1-3 instances of one class in one process, batch and
sequence sizes that change between steps; options: stage 0-3, parameter and optimizer tiers, tiling, activation
checkpointing and activation tiers, world size 1.

Both properties are slow (``--all`` only; the default run has none). Examples per run: 8 with
``run_tests.sh --all`` (profile ``ci``, what CI runs), 3 under the file's default profile (``pytest -m slow
tests/integration/test_usage_properties.py``); run ``HYPOTHESIS_PROFILE=thorough pytest -m slow
tests/integration/test_usage_properties.py`` for 60.
"""

from __future__ import annotations

import dataclasses
import functools

import profiles
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from usage import Pair, loss_of, train_interleaved

import zinf_compiler as zinf

# Both properties run only in the whole suite (each drawn case compiles with Inductor: about a minute each);
# the usage patterns they mix run by default in test_usage_patterns.py.
pytestmark = pytest.mark.slow
# quick (the default: pytest -m slow on this file): 3 drawn cases per property; ci: 8 (run_tests.sh --all sets
# it); HYPOTHESIS_PROFILE=thorough draws 60 (tests/support/profiles.py).
profiles.load()

WIDTH = 8
BREAK_PLACES = ("start", "middle", "end")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    depth: int
    break_at: tuple[str | None, ...]  # per block: where its forward breaks the graph, or None
    tie: tuple[int, int] | None  # blocks (i, j): j's fc2 weight is i's
    frozen: int | None  # this block's fc1 does not train
    counting_buffer: bool  # blocks update a buffer in forward
    conv: int | None = None  # blocks open with a Conv1d over the sequence of this kernel size
    args_wrapped: bool = False  # the model's forward is reached through ``def wrapper(*args, **kwargs)``
    hook: int | None = None  # this block's fc2 weight has a (clamping) gradient hook


class GrammarBlock(torch.nn.Module):
    def __init__(self, break_at: str | None, counting: bool, conv: int | None = None):
        super().__init__()
        # A convolution's weight under Inductor's layout passes: a conv net at stage 3 crashed once.
        self.conv = (torch.nn.Conv1d(WIDTH, WIDTH, conv, padding=conv // 2) if conv is not None else None)
        self.fc1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))
        self.counting = counting
        if counting:
            self.register_buffer("calls", torch.zeros(()))
        self.break_at = break_at

    def forward(self, x):
        if self.break_at == "start":
            torch._dynamo.graph_break()
        if self.conv is not None:  # (rows, length, WIDTH): channels are WIDTH, the sequence is length
            x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        hidden = torch.tanh(self.fc1(x * self.scale))
        if self.break_at == "middle":
            torch._dynamo.graph_break()
        if self.counting:
            self.calls.add_(1)
        out = x + self.fc2(hidden)
        if self.break_at == "end":
            torch._dynamo.graph_break()
        return out


class GrammarModel(torch.nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.blocks = torch.nn.ModuleList(GrammarBlock(spec.break_at[i], spec.counting_buffer, spec.conv)
                                          for i in range(spec.depth))
        if spec.tie is not None:
            source, target = spec.tie
            self.blocks[target].fc2.weight = self.blocks[source].fc2.weight
        if spec.frozen is not None:
            self.blocks[spec.frozen].fc1.requires_grad_(False)
        self.head = torch.nn.Linear(WIDTH, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _args_wrapper(forward):
    """What Hugging Face's forward decorators do: Dynamo then names the model ``L['args'][0]``."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapper


class WrappedGrammarModel(GrammarModel):
    forward = _args_wrapper(GrammarModel.forward)


def build_model(spec: ModelSpec) -> GrammarModel:
    return (WrappedGrammarModel if spec.args_wrapped else GrammarModel)(spec)


def clamp_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.clamp(-0.02, 0.02)  # not linear: it must see the same gradient as in eager


def add_hooks(pair: Pair, spec: ModelSpec, options: dict) -> None:
    """The spec's gradient hook on both models.  Not on tiled weights, nor on tied ones (used across a graph
    break their gradient comes in pieces): zinf refuses both, tested in tests/integration/test_grad_hooks.py."""
    if spec.hook is None or options.get("tile_factor") or (spec.tie is not None and spec.hook in spec.tie):
        return
    for model in (pair.eager, pair.zinf_model):
        model.blocks[spec.hook].fc2.weight.register_hook(clamp_grad)


@st.composite
def model_specs(draw) -> ModelSpec:
    depth = draw(st.integers(1, 3))
    break_at = tuple(draw(st.sampled_from((None,) + BREAK_PLACES)) for _ in range(depth))
    tie = None
    if depth >= 2 and draw(st.booleans()):
        source = draw(st.integers(0, depth - 2))
        tie = (source, draw(st.integers(source + 1, depth - 1)))
    frozen = draw(st.one_of(st.none(), st.integers(0, depth - 1)))
    return ModelSpec(depth, break_at, tie, frozen, draw(st.booleans()),
                     conv=draw(st.sampled_from([None, 1, 3])), args_wrapped=draw(st.booleans()),
                     hook=draw(st.one_of(st.none(), st.integers(0, depth - 1))))


@st.composite
def option_sets(draw, nvme_path: str) -> dict:
    stage = draw(st.sampled_from([0, 1, 2, 3]))
    options = {"stage": stage, "nvme_path": nvme_path}  # the default lowering (Inductor), as users get it
    if stage >= 1:
        options["offload_optimizer"] = draw(st.sampled_from(["none", "cpu", "nvme"]))
        if options["offload_optimizer"] == "nvme":
            options["nvme_grad_ram_bytes"] = draw(st.sampled_from([0, 2048, 1 << 30]))  # none, some, all in RAM
    if stage == 3:
        options["offload_param"] = draw(st.sampled_from(["none", "cpu", "nvme"]))
        if draw(st.booleans()):
            options.update(tile_threshold=256, tile_factor=2)  # every fc weight (512 bytes) in 2 tiles
    options["activation_checkpointing"] = draw(st.sampled_from(["none", "block", "auto"]))
    if options["activation_checkpointing"] == "auto":
        options["activation_memory_budget"] = draw(st.sampled_from([0.05, 0.3, 1.0]))
    options["offload_activations"] = draw(st.sampled_from(["none", "cpu", "nvme"]))
    if options["offload_activations"] != "none":
        options["activation_offload_min_bytes"] = 0  # the grammar's activations are all tiny
    return options


def input_shapes(draw_from=st.integers) -> st.SearchStrategy:
    return st.lists(st.tuples(st.integers(1, 3), st.integers(1, 4)), min_size=2, max_size=3)


# What a user may do between two training steps, to both models alike.
BETWEEN_STEPS = ("nothing", "inference", "load_state_dict", "gathered")


@given(spec=model_specs(), data=st.data(), instances=st.integers(1, 3), shapes=input_shapes(),
       between=st.sampled_from(BETWEEN_STEPS))
def test_drawn_models_train_like_eager(spec, data, instances, shapes, between, tmp_path_factory):
    nvme_path = str(tmp_path_factory.mktemp("swap"))
    options = data.draw(option_sets(nvme_path))
    torch._dynamo.reset()
    pairs = []
    # Adam where the optimizer state is on NVMe (zinf streams only Adam/AdamW from disk);
    # eps as in tests/support/equivalence.py, fused as zinf's inner optimizer.
    optimizer = ({"optimizer": "Adam", "lr": 1e-2, "eps": 1e-6, "fused": True}
                 if options.get("offload_optimizer") == "nvme" else {"optimizer": "SGD"})
    for seed in range(instances):
        torch.manual_seed(seed)
        pairs.append(Pair(build_model(spec), options, **optimizer))
        add_hooks(pairs[-1], spec, options)
    generator = torch.Generator().manual_seed(len(shapes))
    batches = [torch.randn(rows, length, WIDTH, generator=generator) for rows, length in shapes]
    # Blocks that differ in where they break and shapes of size 1 (specialized) give each
    # block's code object many guarded variants: more than Dynamo's default limit of 8 is
    # expected here, and the property is about results, not recompiles.
    with torch._dynamo.config.patch(recompile_limit=64):
        losses = train_interleaved(pairs, batches, steps=1)
        for pair in pairs:
            _between_steps(pair, between, batches[0])
        more = train_interleaved(pairs, batches[1:], steps=len(batches) - 1)
    for index, (pair, pair_losses) in enumerate(zip(pairs, losses)):
        pair_losses = pair_losses + more[index]
        pair.assert_equal(pair_losses, f"instance {index} of {spec}, {options}, shapes {shapes}, then {between}")
        for (name, eager_buffer), (_, zinf_buffer) in zip(pair.eager.named_buffers(), pair.zinf_model.named_buffers()):
            torch.testing.assert_close(zinf_buffer, eager_buffer, msg=f"buffer {name}")


def _between_steps(pair: Pair, between: str, x: torch.Tensor) -> None:
    if between == "inference":
        with torch.inference_mode():
            torch.testing.assert_close(pair.compiled(x), pair.eager(x), rtol=1e-5, atol=1e-6)
    elif between == "gathered":
        # Eager code on the full parameters, and an in-place change kept (writeback).
        with zinf.gathered(pair.compiled, writeback=True):
            torch.testing.assert_close(pair.zinf_model(x), pair.eager(x), rtol=1e-5, atol=1e-6)
            for param in pair.zinf_model.parameters():
                if param.is_floating_point():
                    param.mul_(0.9)
        with torch.no_grad():
            for param in pair.eager.parameters():
                if param.is_floating_point():
                    param.mul_(0.9)
    elif between == "load_state_dict":
        # New weights into the trained models (stage 3: written into the shards).
        state = {name: value.detach() * 0.5 + 0.01 for name, value in pair.eager.state_dict().items()
                 if value.is_floating_point()}
        pair.eager.load_state_dict(state, strict=False)
        pair.zinf_model.load_state_dict(state, strict=False)


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """How the training loop around the model is written."""

    optimizer: str
    optimizer_kwargs: tuple  # (name, value) pairs
    head_lr_scale: float | None  # the head in its own param group at this share of the lr
    micro_batches: int  # gradient accumulation: backward this many times per step
    max_norm: float | None  # clip the gradient norm (small enough to clip)
    set_to_none: bool  # zero_grad's argument
    clip_with_torch: bool  # torch.nn.utils.clip_grad_norm_(model.parameters()), else the zinf optimizer's


@st.composite
def loop_specs(draw, offload_optimizer: str | None) -> LoopSpec:
    # zinf streams only Adam and AdamW from NVMe; elsewhere any of its optimizers.
    choices = ["Adam", "AdamW"] if offload_optimizer == "nvme" else ["SGD", "Adam", "AdamW"]
    optimizer = draw(st.sampled_from(choices))
    if optimizer == "SGD":
        kwargs = draw(st.sampled_from([(), (("momentum", 0.9),),
                                       (("momentum", 0.9), ("nesterov", True), ("weight_decay", 0.01))]))
    else:
        kwargs = (("eps", 1e-6), ("fused", True)) + draw(st.sampled_from([(), (("weight_decay", 0.05),)]))
    return LoopSpec(optimizer, kwargs, draw(st.sampled_from([None, 0.1])), draw(st.integers(1, 2)),
                    draw(st.sampled_from([None, 0.05])), draw(st.booleans()), draw(st.booleans()))


def _head_apart(scale: float | None, lr: float):
    if scale is None:
        return None

    def groups(model):
        head = [p for name, p in model.named_parameters() if name.startswith("head.")]
        body = [p for name, p in model.named_parameters() if not name.startswith("head.")]
        return [{"params": body}, {"params": head, "lr": lr * scale}]
    return groups


def _loop_step(model, optimizer, batch_pieces, loop: LoopSpec, clip) -> float:
    total = 0.0
    for piece in batch_pieces:
        loss = loss_of(model(piece)) / len(batch_pieces)
        loss.backward()
        total += loss.item()
    if loop.max_norm is not None:
        clip(loop.max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=loop.set_to_none)
    return total


@given(spec=model_specs(), data=st.data(), shapes=input_shapes())
def test_drawn_training_loops_match_eager(spec, data, shapes, tmp_path_factory):
    """Optimizers, param groups, accumulation, clipping and zero_grad as users write them."""
    options = data.draw(option_sets(str(tmp_path_factory.mktemp("swap"))))
    loop = data.draw(loop_specs(options.get("offload_optimizer")))
    torch._dynamo.reset()
    lr = 1e-2
    torch.manual_seed(0)
    pair = Pair(build_model(spec), options, lr=lr, optimizer=loop.optimizer,
                param_groups=_head_apart(loop.head_lr_scale, lr), **dict(loop.optimizer_kwargs))
    add_hooks(pair, spec, options)
    generator = torch.Generator().manual_seed(len(shapes))
    batches = [torch.randn(rows * loop.micro_batches, length, WIDTH, generator=generator) for rows, length in shapes]
    losses = []
    with torch._dynamo.config.patch(recompile_limit=64):
        for batch in batches + batches[:1]:
            pieces = batch.chunk(loop.micro_batches)
            eager_loss = _loop_step(pair.eager, pair.eager_opt, pieces, loop,
                                    lambda norm: torch.nn.utils.clip_grad_norm_(pair.eager.parameters(), norm))
            zinf_clip = (functools.partial(torch.nn.utils.clip_grad_norm_, pair.zinf_model.parameters())
                         if loop.clip_with_torch else pair.zinf_opt.clip_grad_norm_)
            zinf_loss = _loop_step(pair.compiled, pair.zinf_opt, pieces, loop, zinf_clip)
            losses.append((eager_loss, zinf_loss))
    pair.assert_equal(losses, f"{spec}, {options}, {loop}, shapes {shapes}")
