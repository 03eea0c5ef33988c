"""Issue 16: activation checkpointing ("block", "auto") and saved activations offloaded to CPU or NVMe."""

import gc
import json
import re

import pytest
import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from zinf_compiler.options import ZinfOptionError, parse_options
from zinf_compiler.api import RUNTIME

from equivalence import compare_training

@pytest.mark.parametrize("policy,tier,profile", [
    ("block", "none", ""), pytest.param("block", "nvme", "", marks=pytest.mark.slow),
    pytest.param("auto", "none", "", marks=pytest.mark.slow), ("auto", "cpu", ""),
    pytest.param("auto", "cpu", "nominal", marks=pytest.mark.slow)])
def test_dropout_masks_are_recomputed_exactly(policy, tier, profile, tmp_path, monkeypatch):
    """Acceptance 1, dropout on: recomputation replays the forward's RNG state, so the masks (and every
    loss and parameter) equal eager's, itself checkpointed with torch.utils.checkpoint.  ``auto`` runs with
    this machine's measured cost profile and with the nominal one (whose rates make it offload some values
    and leave the rest to PyTorch's knapsack): the knapsack recomputing dropout without replaying its RNG
    once gave wrong gradients here."""
    monkeypatch.setenv("ZINF_COST_PROFILE", profile)
    options = {"stage": 3, "lower": "eager", "activation_checkpointing": policy, "offload_activations": tier,
               "activation_offload_min_bytes": 0, "activation_memory_budget": 0.2, "nvme_path": str(tmp_path),
               "dump_dir": str(tmp_path / "dumps")}
    comparison = compare_training(GPTConfig(n_layer=2, dropout=0.2), options, steps=3, reseed=True,
                                  eager_checkpoint=True)
    assert comparison.max_loss_error <= 1e-6 and comparison.max_param_error <= 1e-5, comparison.describe()
    backward = _graph_folder(tmp_path / "dumps").joinpath("backward.05_schedule.py").read_text()
    if policy == "block":
        # The dropout was recomputed in backward (not its mask saved), with the forward's RNG state.
        assert "run_with_rng_state" in backward


@pytest.mark.slow  # a cold Inductor compile per case (a minute or more); Inductor by default: test_backend.py
@pytest.mark.parametrize("policy,tier", [("block", "cpu"), ("none", "nvme")])
def test_inductor_lowering_with_checkpointing_and_offload(policy, tier, tmp_path):
    """The handle that replaces an offloaded value passes Inductor's own bookkeeping of saved values; without
    checkpointing, q, k and v (views with gaps into the fused qkv output) come back contiguous, and the
    backward Inductor compiled is traced against that."""
    options = {"stage": 3, "lower": "inductor", "activation_checkpointing": policy, "offload_activations": tier,
               "activation_offload_min_bytes": 0, "nvme_path": str(tmp_path)}
    comparison = compare_training(GPTConfig(n_layer=2), options, steps=3)
    # Inductor's fused kernels round differently from eager (params agree to ~3e-4 without these options too).
    assert comparison.max_loss_error <= 1e-5 and comparison.max_param_error <= 1e-3, comparison.describe()


def _graph_folder(dumps):
    """The one graph's dump folder (graph ids count up across the process)."""
    (folder,) = [path for path in dumps.iterdir() if path.name.startswith("graph_")]
    return folder


_ASSIGN = re.compile(r'^\s+(\w+)(?:: "[^"]*")? = (.*)$')
_VIEWS = ("aten.t.", "aten.view.", "aten.permute.", "aten.transpose.", "aten.expand.", "aten.slice.",
          "aten.unsqueeze.", "aten.squeeze.", "aten.reshape.", "aten.alias.", "aten._unsafe_view.")


def _defined(graph_text: str) -> dict[str, str]:
    return {match.group(1): match.group(2) for line in graph_text.splitlines() if (match := _ASSIGN.match(line))}


def _from_gathered(name: str, defined: dict[str, str]) -> bool:
    """Whether ``name`` is (a view of) a gathered parameter in the graph ``defined`` describes."""
    while name in defined:
        expression = defined[name]
        if "zinf.gather_wait" in expression or name.startswith("gathered_"):
            return True
        if not any(view in expression for view in _VIEWS) and not re.match(r"^gathered_\w+\[\d+\]", expression):
            return False
        first = re.search(r"\(([A-Za-z_]\w*)", expression) or re.match(r"^(\w+)\[", expression)
        name = first.group(1)
    return name.startswith("gathered_")


@pytest.mark.parametrize("policy", [pytest.param("none", marks=pytest.mark.slow), "block",
                                    pytest.param("auto", marks=pytest.mark.slow)])
def test_no_gathered_parameter_is_saved_for_backward_at_stage_3(policy, tmp_path):
    """Acceptance 3: from the dumped graphs, no saved value is a gathered full parameter (or a view of one)."""
    options = {"stage": 3, "lower": "eager", "activation_checkpointing": policy, "dump_dir": str(tmp_path)}
    compare_training(GPTConfig(n_layer=2), options, steps=2)
    folder = _graph_folder(tmp_path)
    forward = (folder / "forward.05_schedule.py").read_text()
    defined = _defined(forward)
    saved = [row["name"] for row in json.loads((folder / "forward.activations.json").read_text())["saved"]]
    assert saved and any(name.startswith("gathered_") for name in defined), "the check must have something to find"
    # The checker itself finds a gathered value where there is one.
    assert any(_from_gathered(name, defined) for name in defined if name.startswith("gathered_"))
    assert not [name for name in saved if _from_gathered(name, defined)], saved
    backward = (folder / "backward.05_schedule.py").read_text()
    inputs = re.search(r"def forward\(self, ([^)]*)\)", backward).group(1)
    assert "gathered" not in inputs, inputs


def _train_step_report(options, cfg=GPTConfig(n_layer=4, n_embd=64, block_size=64), batch=8):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(cfg)
    compiled = torch.compile(model, backend="zinf", options={"stage": 3, "lower": "eager", **options})
    opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
    reports = []
    for idx, targets in synthetic_batches(cfg, batch, 2):
        loss = compiled(idx, targets)
        reports.append(zinf.memory_report(compiled))
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = zinf.memory_report(compiled)
    return reports[-1], after, compiled


def test_memory_report_counts_activations_per_tier(tmp_path):
    """Acceptance (ledger): between forward and backward, memory_report counts saved-activation bytes on the
    tier they rest on; block checkpointing shrinks them; after backward they are all released."""
    plain, plain_after, _ = _train_step_report({})
    block, _, _ = _train_step_report({"activation_checkpointing": "block"})
    to_cpu, cpu_after, _ = _train_step_report({"activation_checkpointing": "block", "offload_activations": "cpu"})
    to_nvme, nvme_after, _ = _train_step_report({"activation_checkpointing": "block", "offload_activations": "nvme",
                                                 "nvme_path": str(tmp_path)})
    assert plain["device"]["activations"] > 0 and plain["cpu"]["activations"] == 0
    # 4 blocks: each saves only its input instead of ~20 tensors.
    assert block["device"]["activations"] * 3 < plain["device"]["activations"], (block, plain)
    assert to_cpu["cpu"]["activations"] > 0 and to_cpu["device"]["activations"] < block["device"]["activations"]
    assert to_nvme["nvme"]["activations"] == to_cpu["cpu"]["activations"] > 0
    assert to_nvme["device"]["activations"] == to_cpu["device"]["activations"]
    for report in (plain_after, cpu_after, nvme_after):
        assert all(report[tier]["activations"] == 0 for tier in ("device", "cpu", "nvme")), report
    assert RUNTIME.activations.live_entries() == 0
    # The nvme tier stages through its own quota of the process's pinned memory, all given back after backward;
    # the cpu tier draws none of it.
    staging = nvme_after["pinned"]["activations"]
    assert staging["quota"] == RUNTIME.activations.pool_bytes > 0 and staging["in_use"] == 0, nvme_after["pinned"]
    assert 0 < to_nvme["pinned"]["activations"]["peak"] <= staging["quota"], to_nvme["pinned"]
    assert to_cpu["pinned"] == cpu_after["pinned"], (to_cpu["pinned"], cpu_after["pinned"])


def test_offloaded_activations_of_a_dropped_graph_are_freed(tmp_path):
    """A forward whose loss is dropped without backward, and a backward with retain_graph run twice,
    leave no host copy or swap file behind."""
    cfg = GPTConfig(n_layer=2)
    torch._dynamo.reset()
    model = GPT(cfg)
    compiled = torch.compile(model, backend="zinf", options={
        "stage": 3, "lower": "eager", "offload_activations": "nvme", "nvme_path": str(tmp_path),
        "activation_offload_min_bytes": 0})
    idx, targets = synthetic_batches(cfg, 4, 1)[0]
    loss = compiled(idx, targets)
    assert RUNTIME.activations.live_entries() > 0 and RUNTIME.activations.held["nvme"] > 0
    del loss
    gc.collect()
    assert RUNTIME.activations.live_entries() == 0 and RUNTIME.activations.held["nvme"] == 0
    loss = compiled(idx, targets)
    loss.backward(retain_graph=True)
    first = [p.clone() for p in zinf.full_state_dict(compiled).values()]
    assert RUNTIME.activations.live_entries() > 0  # retained for the second backward
    loss.backward()
    del loss
    gc.collect()
    RUNTIME.activations.finish()
    assert RUNTIME.activations.live_entries() == 0 and RUNTIME.activations.held == {"cpu": 0, "nvme": 0}
    assert all(engine.bytes_on_disk() == 0 for engine in RUNTIME.activations.engines())
    assert len(first) > 0


def test_activation_options_parse():
    assert parse_options({"activation_memory_budget": 0.25}).activation_memory_budget == 0.25
    assert parse_options({"activation_memory_budget": "2GiB"}).activation_memory_budget == 2 << 30
    assert parse_options({"activation_memory_budget": "0.5"}).activation_memory_budget == 0.5
    for bad in (0, 1.5, -0.1, "lots"):
        with pytest.raises(ZinfOptionError, match="activation_memory_budget"):
            parse_options({"activation_memory_budget": bad})
    with pytest.raises(ZinfOptionError, match="nvme_path"):
        parse_options({"offload_activations": "nvme"})


def test_nvme_activations_larger_than_the_staging_pool_stream_in_pieces(tmp_path):
    """A saved value larger than the staging pool moves in pieces (one swap key each) through a pool that
    never grows past its bound, and training equals eager; swap files and staging are all freed after."""
    RUNTIME.activations.set_staging_bounds(64 << 10, 64 << 10)  # 16 KiB pieces; the logits here are 128 KiB
    written_before = sum(engine.bytes_written for engine in RUNTIME.activations.engines())
    try:
        options = {"stage": 3, "lower": "eager", "offload_activations": "nvme", "nvme_path": str(tmp_path),
                   "activation_offload_min_bytes": 0, "dump_dir": str(tmp_path / "dumps")}
        comparison = compare_training(GPTConfig(n_layer=2), options, steps=3)
        assert comparison.max_loss_error <= 1e-6 and comparison.max_param_error <= 1e-5, comparison.describe()
        # Every saved activation left, the views with gaps (q, k, v) included.
        saved = json.loads(_graph_folder(tmp_path / "dumps").joinpath("forward.activations.json").read_text())
        activations = [row for row in saved["saved"] if row["kind"] == "activation"]
        assert len(activations) > 10 and all(row["where"] == "nvme" for row in activations), activations
        assert RUNTIME.activations.pool_bytes == 64 << 10
        RUNTIME.activations.finish()
        assert sum(engine.bytes_written for engine in RUNTIME.activations.engines()) > written_before + (1 << 20)
        assert RUNTIME.activations.live_entries() == 0
        assert all(engine.bytes_on_disk() == 0 for engine in RUNTIME.activations.engines())
    finally:
        RUNTIME.activations.set_staging_bounds(64 << 20, 256 << 20)


def _saved_values(sizes_mib: list[int]) -> list[torch.fx.Node]:
    graph = torch.fx.Graph()
    nodes = []
    for index, size in enumerate(sizes_mib):
        node = graph.call_function(torch.ops.aten.relu.default, ())
        node.meta["val"] = torch.empty(size << 18)  # size MiB of fp32
        node._rename(f"value_{index}")
        nodes.append(node)
    return nodes


class _FakeCostModel:
    """1 GB/s each way on disk and link; recomputing any value costs ``recompute_s``."""

    def __init__(self, device: str, recompute_s: float):
        self.profile = type("Profile", (), {"device": device})()
        self.recompute_s = recompute_s

    def node_seconds(self, node):
        return self.recompute_s

    def transfer_seconds(self, step, nbytes):
        return nbytes / 1e9


def test_auto_prices_offload_by_the_transfer_time_compute_cannot_hide():
    """The "auto" cost model: an offload costs what its transfers add beyond the compute they overlap
    (on CUDA: copies and disk both hide; on a CPU device the staging copies use the compute cores)."""
    from zinf_compiler.recompute import choose_per_tensor

    def choices(device, recompute_s, forward_seconds, sizes=(8, 8, 8, 8)):
        decisions = choose_per_tensor(_saved_values(list(sizes)), 0, _FakeCostModel(device, recompute_s), "nvme",
                                      0, forward_seconds)
        return [decision["choice"] for decision in decisions], decisions

    # A long forward hides every transfer on a GPU: offload costs nothing, however cheap recomputing is.
    chosen, decisions = choices("cuda", 1e-4, forward_seconds=1.0)
    assert chosen == ["offload"] * 4 and all(d["offload_ms"] == 0 for d in decisions), decisions
    # No compute to hide behind: 8 MiB out and back over 1 GB/s links and disk (4 channels, ~33.5 ms) is
    # dearer than a 20 ms recompute, cheaper than a 50 ms one.
    assert choices("cuda", 0.020, forward_seconds=0.0)[0] == ["recompute"] * 4
    assert choices("cuda", 0.050, forward_seconds=0.0)[0] == ["offload"] * 4
    # A window that hides two values' transfers (a forward of 20 ms, a backward of 40 ms): a third would
    # push the forward's copy and write past it (~10.4 ms exposed), more than its 5 ms recompute.
    assert choices("cuda", 0.005, forward_seconds=0.020)[0] == ["offload", "offload", "recompute", "recompute"]
    # A CPU device: nothing hides (copies, checksums and I/O threads share the compute cores), so even in
    # a long forward the four transfers (~33.5 ms) beat a 30 ms recompute, not a 50 ms one.
    assert choices("cpu", 0.030, forward_seconds=1.0)[0] == ["recompute"] * 4
    assert choices("cpu", 0.050, forward_seconds=1.0)[0] == ["offload"] * 4


@pytest.mark.parametrize("budget", [pytest.param(256 << 10, marks=pytest.mark.slow), 64 << 10])
def test_auto_with_offload_keeps_the_device_under_a_byte_budget(budget, tmp_path, monkeypatch):
    """``auto`` with offload and a byte budget: whatever the cost model chose and whatever else the
    partitioner saved, the saved-activation bytes left on the device (memory_report between forward and
    backward) fit the budget, and the rest was offloaded.

    On the nominal cost profile: rates measured on a loaded machine moved the recompute/offload choices
    between runs (it failed twice on a fresh clone under load), and what is tested here is the budget,
    not the choices (those: test_auto_prices_offload_by_the_transfer_time_compute_cannot_hide)."""
    monkeypatch.setenv("ZINF_COST_PROFILE", "nominal")
    report, _, _ = _train_step_report({"activation_checkpointing": "auto", "activation_memory_budget": budget,
                                       "offload_activations": "cpu", "activation_offload_min_bytes": 0})
    plain, _, _ = _train_step_report({})
    assert plain["device"]["activations"] > 4 * budget  # the budget binds
    assert report["device"]["activations"] <= budget, (report["device"], budget)
    assert report["cpu"]["activations"] > 0
