"""The RAM cache over the NVMe tier (option host_memory): a model whose parameters rest some on the cpu tier,
some on NVMe trains bit-equal to the all-NVMe run and equal to eager, and resumes from a checkpoint exactly.

The choice itself: tests/unit/test_ram_cache_choice.py."""

import gc

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler import ram_cache
from zinf_compiler.api import RUNTIME
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from plan_bytes import ram_per_element

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BATCHES = synthetic_batches(CFG, 4, 6)
ADAMW = dict(lr=1e-2, eps=1e-6, fused=True)
WHOLE, GRAD = ram_per_element("cpu", "cpu")  # a parameter cached whole (fp32: the shard is the master), its gradient
OPTIMIZER_ONLY, _ = ram_per_element("device", "cpu")  # its optimizer state alone (the shard on the device)


def _pinned_pool_bytes(tmp_path) -> int:
    """The process's pinned pool ("auto") once this model is planned (the one an earlier model made, grown to
    fit this one's too, or the one made for it), which the cache charges, plus what models of earlier tests
    still alive in this process hold (the budget is the process's: ram_cache.held_by_records)."""
    gc.collect()
    RUNTIME.store.collect()
    RUNTIME.store.configure_offload(str(tmp_path), "auto", 1 << 20, 8, 4, 2)
    RUNTIME.store.pinned_pool(0)  # (made now, so that the cache charges it: the run grows it to fit the model)
    with torch.device("meta"):
        planned = zinf.plan(GPT(CFG), None, {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                                            "nvme_path": str(tmp_path)}).pinned["parameters"]
    made = RUNTIME.store.pinned.capacity_bytes if RUNTIME.store.pinned is not None else 0
    return max(made, planned) + ram_cache.held_by_records(RUNTIME.store.records())


def _host_memory_for_a_mix(mixed: str, pinned: int) -> int:
    """A host_memory whose states budget (ram_cache.states_budget) holds half the parameters whole (``mixed``
    "whole": shard and optimizer state) or, the shards on the device, half the optimizer states ("device")."""
    numel = sum(p.numel() for p in GPT(CFG).parameters())
    cached = {"whole": WHOLE * numel // 2, "device": OPTIMIZER_ONLY * numel // 2}[mixed]
    wanted = pinned + GRAD * numel + cached
    return int(wanted / (1 - ram_cache.HEADROOM_FRACTION))


class Run:
    def __init__(self, options: dict):
        torch._dynamo.reset()
        torch.manual_seed(0)
        self.model = GPT(CFG)
        self.compiled = torch.compile(self.model, backend="zinf", options={"lower": "eager", **options})
        self.opt = zinf.optim.AdamW(self.model.parameters(), **ADAMW)

    def train(self, steps) -> list[float]:
        losses = []
        for step in steps:
            loss = self.compiled(*BATCHES[step])
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            losses.append(loss.item())
        return losses

    def state(self) -> dict:
        return {k: v.clone() for k, v in zinf.full_state_dict(self.compiled).items()}

    def tiers(self) -> list[tuple[str, str]]:
        return [(r.param_tier, r.opt_tier) for r in map(RUNTIME.store.lookup, self.model.parameters())]


def _options(tmp_path, offload_param: str, mixed: str | None) -> dict:
    """Parameters on ``offload_param``, optimizer state on NVMe; ``mixed``: which states the cache splits
    between RAM and NVMe (None: no host_memory, all on NVMe)."""
    options = dict(stage=3, offload_param=offload_param, offload_optimizer="nvme", nvme_path=str(tmp_path))
    if mixed is not None:
        options["host_memory"] = _host_memory_for_a_mix(mixed, _pinned_pool_bytes(tmp_path))
    return options


def _bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8),
                                                                                  b[k].view(torch.uint8)) for k in a)


# The default run: whole parameters in RAM or on NVMe (those stepped during backward); shards on the device: slow.
@pytest.mark.parametrize("offload_param, mixed", [("nvme", "whole"),
                                                  pytest.param("none", "device", marks=pytest.mark.slow)])
def test_a_cached_run_is_bit_equal_to_the_all_nvme_run_and_equals_eager(tmp_path, offload_param, mixed):
    steps = range(4)
    torch.manual_seed(0)
    eager = GPT(CFG)
    eager_opt = torch.optim.AdamW(eager.parameters(), **ADAMW)
    eager_losses = []
    for step in steps:
        loss = eager(*BATCHES[step])
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        eager_losses.append(loss.item())

    cached = Run({**_options(tmp_path, offload_param, mixed), "dump_dir": str(tmp_path / "dump")})
    cached_losses = cached.train(steps)
    tiers = cached.tiers()
    # Parameters and optimizer state both on NVMe step during backward (overlap_optimizer), the others after it.
    stepped_early = {r.step_in_backward for r in map(RUNTIME.store.lookup, cached.model.parameters())}
    cached_state = cached.state()
    report = zinf.memory_report(cached.compiled)
    del cached
    everything_on_disk = Run(_options(tmp_path, offload_param, None))
    nvme_losses = everything_on_disk.train(steps)
    assert all("cpu" not in pair for pair in everything_on_disk.tiers())

    # The mix happened: some parameters' states in RAM, some on NVMe; with both offloaded, each whole on one tier.
    assert {opt_tier for _, opt_tier in tiers} == {"cpu", "nvme"}, tiers
    if offload_param == "nvme":
        assert set(tiers) == {("cpu", "cpu"), ("nvme", "nvme")}, tiers
    assert report["cpu"]["optimizer"] > 0 and report["nvme"]["optimizer"] > 0, report
    # The dumps name the parameters kept in RAM.
    lines = [line for path in (tmp_path / "dump").rglob("*.py") for line in path.read_text().splitlines()
             if "ram cache (host_memory" in line]
    assert lines and all("the rest on nvme" in line for line in lines), lines
    assert stepped_early == ({True, False} if mixed == "whole" else {False})
    assert cached_losses == nvme_losses
    assert _bit_equal(cached_state, everything_on_disk.state())
    assert cached_losses == pytest.approx(eager_losses, rel=1e-5)
    for name, value in eager.named_parameters():
        torch.testing.assert_close(cached_state[name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # checkpoints of mixed tiers: the bit-equal run above covers the tiers themselves
def test_a_cached_run_resumes_from_a_checkpoint_bit_identically(tmp_path):
    options = _options(tmp_path, "nvme", "whole")
    straight = Run(options)
    expected_losses = straight.train(range(6))
    expected = straight.state()
    del straight
    first = Run(options)
    first.train(range(3))
    zinf.save(tmp_path / "ckpt", first.compiled, first.opt)
    del first
    resumed = Run(options)
    zinf.load(tmp_path / "ckpt", resumed.compiled, resumed.opt)
    assert resumed.train(range(3, 6)) == expected_losses[3:]
    assert {param_tier for param_tier, _ in resumed.tiers()} == {"cpu", "nvme"}
    assert _bit_equal(resumed.state(), expected)


@pytest.mark.slow
def test_materialize_plans_the_whole_model_and_adopts_it_as_planned(tmp_path):
    """zinf.materialize plans the meta-device parameters at once and adopts the real ones built from them."""
    states, tiers = [], []
    for mixed in ("whole", None):
        torch._dynamo.reset()
        options = {"lower": "eager", **_options(tmp_path, "nvme", mixed)}
        with torch.device("meta"):
            model = GPT(CFG)
        torch.manual_seed(0)
        zinf.materialize(model, options, init_fn=model.init_weights)
        tiers.append({(r.param_tier, r.opt_tier) for r in map(RUNTIME.store.lookup, model.parameters())})
        compiled = torch.compile(model, backend="zinf", options=options)
        opt = zinf.optim.AdamW(model.parameters(), **ADAMW)
        for batch in BATCHES[:2]:
            compiled(*batch).backward()
            opt.step()
            opt.zero_grad()
        states.append({k: v.clone() for k, v in zinf.full_state_dict(compiled).items()})
        del model, compiled, opt
    assert {param_tier for param_tier, _ in tiers[0]} == {"cpu", "nvme"} and tiers[1] == {("nvme", "nvme")}, tiers
    assert _bit_equal(*states)


@pytest.mark.slow
def test_with_every_state_in_ram_nothing_is_on_nvme(tmp_path):
    numel = sum(p.numel() for p in GPT(CFG).parameters())
    everything = _pinned_pool_bytes(tmp_path) + (GRAD + WHOLE) * numel
    host_memory = int(everything / (1 - ram_cache.HEADROOM_FRACTION)) + 1
    options = {**_options(tmp_path, "nvme", None), "host_memory": host_memory}
    run = Run(options)
    run.train(range(1))
    assert set(run.tiers()) == {("cpu", "cpu")}
    assert zinf.memory_report(run.compiled)["nvme"] == dict.fromkeys(zinf.memory_report(run.compiled)["nvme"], 0)


class _TwoGraphs(torch.nn.Module):
    """Two layers a graph break splits into two graphs, adopted one after the other."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(64, 64, bias=False)
        self.second = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        x = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(x).square().mean()


def test_graphs_spend_one_budget_first_come_first_served(tmp_path):
    """The second graph sees what the first one's cache holds: a budget for one layer caches the first only."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TwoGraphs()
    numel = model.first.weight.numel()
    one_layer = WHOLE * numel
    wanted = _pinned_pool_bytes(tmp_path) + 2 * GRAD * numel + one_layer + numel
    options = {**_options(tmp_path, "nvme", None), "lower": "eager",
               "host_memory": int(wanted / (1 - ram_cache.HEADROOM_FRACTION)) + 1}
    compiled = torch.compile(model, backend="zinf", options=options)
    opt = zinf.optim.AdamW(model.parameters(), **ADAMW)
    for _ in range(2):
        compiled(torch.randn(8, 64)).backward()
        opt.step()
        opt.zero_grad()
    tiers = [(r.param_tier, r.opt_tier) for r in map(RUNTIME.store.lookup, (model.first.weight, model.second.weight))]
    assert tiers == [("cpu", "cpu"), ("nvme", "nvme")]
