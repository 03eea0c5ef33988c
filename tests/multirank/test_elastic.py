"""A lost rank: examples/train_gpt.py under torchrun continues by itself from its last checkpoint.

Issue 37, acceptance 4.  Each run here is torchrun (``python -m torch.distributed.run``) over the example
with NVMe tiers, a tiny GPT and ``--resume auto``; the fault is tests/workers/faulty_example.py, the
example with a worker SIGKILLed in the middle of a step on the first attempt only:

* restart at the same world size (``--max-restarts 1``, world 2): the run ends by itself, every loss and
  the exported final parameters equal an uninterrupted run's bit for bit;
* the same under a pipeline (``--pp 2``, world 4): the killed rank's stage and the other reload their folders
  of the pipeline's checkpoint; losses and the exported files equal an uninterrupted run's bit for bit;
* elastic (``--nnodes 1:2``, two agents of one process each): the agent of one node dies with its worker;
  the other re-rendezvouses alone, resumes at world 1 through the resharding load and finishes, its losses
  those of eager PyTorch on the same global batches.

Every torchrun has a hard timeout; on failure its agent and workers are SIGKILLed (found by a marker in
their environment: torchrun starts workers in their own sessions).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from multirank import free_port
from repo_paths import REPO, worker_env, worker_script

sys.path.insert(0, str(REPO / "examples"))
import train_gpt  # noqa: E402

from zinf_compiler.gpt import GPT, GPTConfig  # noqa: E402

# The example's model and data, small: a step takes well under a second.
SIZES = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=4)
EXAMPLE = ["--lower", "eager", "--offload", "nvme", "--steps", "7", "--save-every", "3", "--log-every", "1",
           "--sample-tokens", "1", "--resume", "auto",
           *[arg for name, value in SIZES.items() for arg in (f"--{name.replace('_', '-')}", str(value))]]
KILL_STEP = 5  # in the middle of step 5: the checkpoint of step 3 is the newest
TIMEOUT = 300


def _processes_marked(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``marker`` (this test's torchrun agents and workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if marker.encode() in environ.read():
                        pids.append(int(entry))
            except OSError:
                pass  # gone, or not ours
    return pids


class Torchrun:
    """One ``python -m torch.distributed.run`` over a script, its output in ``log``."""

    def __init__(self, torchrun_args: list[str], script: str, script_args: list[str], log, **env: str):
        self.marker = f"ZINFTEST_RUN={uuid.uuid4().hex}"
        name, value = self.marker.split("=")
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *torchrun_args, script, *script_args],
                # A store per attempt for the workers' process group: on torchrun's shared rendezvous store a
                # restarted rank 0 can read the dead attempt's gloo addresses (seen: "Gloo connectFullMesh
                # failed ... Connection refused" to the killed rank's old port, 1 restart in 3).
                env=worker_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
                               PYTHONWARNINGS="ignore::FutureWarning", **{name: value}, **env),
                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stuck = self.kill(dump_stacks=True)
            raise AssertionError(f"torchrun still running after {timeout} s; killed {stuck}:\n{self.output()[-8000:]}")

    def kill(self, dump_stacks: bool = False) -> list[str]:
        """SIGKILL the agent and its workers; ``dump_stacks``: first SIGABRT them (PYTHONFAULTHANDLER prints
        every thread's stack into the log).  Returns the command lines of those still alive."""
        pids = _processes_marked(self.marker)
        alive = []
        for pid in pids:
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    command = cmdline.read().replace(b"\0", b" ").decode()
                alive.append(f"{pid}: {command[-200:]}")
        if dump_stacks and pids:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGABRT)
            time.sleep(2)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        return alive

    def output(self) -> str:
        with open(self.log) as log:
            return log.read()


def _losses(path) -> dict[int, str]:
    """step -> the loss's repr; a step run again after a restart: its last line."""
    with open(path) as lines:
        return {int(step): loss for step, loss in (line.split() for line in lines)}


def _run_to_the_end(run: Torchrun) -> str:
    try:
        code = run.wait()
    finally:
        run.kill()  # workers left behind by a failure
    output = run.output()
    assert code == 0, f"torchrun exit {code}:\n{output[-6000:]}"
    return output


def _straight_and_faulty(tmp_path, world: int, example: list[str], kill_rank: int) -> list[str]:
    """An uninterrupted torchrun of the example and one whose rank ``kill_rank`` SIGKILLs itself in step KILL_STEP
    (``--max-restarts 1``), at ``world``; checks the restart resumed from step 3's checkpoint and ended with every
    loss equal; returns the names of the exported files (under ``<tmp_path>/<straight|faulty>/export``)."""
    standalone = ["--standalone", "--nproc-per-node", str(world), "--max-restarts", "1", "--monitor-interval", "0.2"]
    runs = {}
    for name, script, env in (("straight", str(REPO / "examples" / "train_gpt.py"), {}),
                              ("faulty", worker_script("faulty_example"),
                               {"ZINFTEST_KILL_STEP": str(KILL_STEP), "ZINFTEST_KILL_RANK": str(kill_rank)})):
        folder = tmp_path / name
        args = [*example, "--nvme-path", str(folder / "swap"), "--checkpoint-dir", str(folder / "ckpt"),
                "--loss-file", str(folder / "losses"), "--export", str(folder / "export")]
        runs[name] = _run_to_the_end(Torchrun(standalone, script, args, tmp_path / f"{name}.log", **env))
    faulty = runs["faulty"]
    assert f"rank {kill_rank} SIGKILLs itself in step {KILL_STEP}" in faulty, faulty[-6000:]
    assert re.search(rf"resumed from \S+step-000003 at step 4, world {world} \(saved at world {world}; torchrun "
                     rf"restart 1\)", faulty), faulty[-6000:]
    assert "resumed" not in runs["straight"]
    straight_losses = _losses(tmp_path / "straight" / "losses")
    assert sorted(straight_losses) == list(range(1, 8))
    assert _losses(tmp_path / "faulty" / "losses") == straight_losses
    return sorted(path.name for path in (tmp_path / "straight" / "export").iterdir() if path.suffix != ".json")


def _assert_same_exports(tmp_path, files: list[str]) -> None:
    for file in files:
        assert (tmp_path / "faulty" / "export" / file).read_bytes() == \
            (tmp_path / "straight" / "export" / file).read_bytes(), f"{file}: the final parameters differ"


@pytest.mark.slow  # three torchrun launches with compiles: about a minute on 2 cores
def test_a_rank_sigkilled_mid_step_restarts_and_ends_bit_identical(tmp_path):
    files = _straight_and_faulty(tmp_path, 2, EXAMPLE, kill_rank=1)
    assert files == ["model.safetensors"], files
    _assert_same_exports(tmp_path, files)


@pytest.mark.slow  # three torchrun launches of 4 ranks with compiles: about a minute on 2 cores
def test_a_pipeline_rank_sigkilled_mid_step_restarts_and_ends_bit_identical(tmp_path):
    """Issue 52, acceptance 3: pp 2 x dp 2 (NVMe tiers), a rank of the second stage SIGKILLed mid-step; torchrun
    restarts the four ranks, each stage reloads its folder of the pipeline's checkpoint, and the run ends with
    every loss and the exported parameters (a file per stage) equal to an uninterrupted run's."""
    files = _straight_and_faulty(tmp_path, 4, [*EXAMPLE, "--pp", "2", "--n-layer", "2"], kill_rank=3)
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], files
    assert (tmp_path / "straight" / "export" / "model.safetensors.index.json").exists()
    _assert_same_exports(tmp_path, files)


def _eager_losses(steps: int, world_at, lr: float = 3e-3, seed: int = 0) -> dict[int, float]:
    """The example's training in eager PyTorch on each step's global batch (``world_at(step)`` ranks'
    shares): step -> rank 0's loss (the one the example logs) before that step's update."""
    cfg = GPTConfig(vocab_size=256, **{k: v for k, v in SIZES.items() if k != "batch_size"})
    torch.manual_seed(seed)
    model = GPT(cfg)
    torch.manual_seed(seed)  # the example builds on meta and zinf.materialize runs init_weights per module
    model.apply(model.init_weights)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 20))
    data = torch.frombuffer(bytearray(train_gpt.make_corpus(400_000, seed)), dtype=torch.uint8)
    batch = SIZES["batch_size"]
    losses = {}
    for step in range(1, steps + 1):
        # Rank 0 of world 1 with world x batch rows: every rank's share, in rank order.
        idx, targets = train_gpt.batch_at(data, step, 0, 1, world_at(step) * batch, cfg.block_size, seed)
        with torch.no_grad():
            losses[step] = model(idx[:batch], targets[:batch]).item()
        model(idx, targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        schedule.step()
    return losses


@pytest.mark.slow  # two torchrun agents, a rendezvous after a node's heartbeats expire: about a minute
def test_elastic_run_loses_a_node_and_resumes_at_world_1_like_eager(tmp_path):
    port = free_port()
    # is_host: the surviving agent hosts the rendezvous store (both agents match the endpoint's host).
    # Short heartbeats: the dead node leaves the rendezvous after 3 s; last call: both join round 0.
    conf = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=10"
    elastic = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-id", "zinf-elastic",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "1", "--monitor-interval", "0.2"]
    args = [*EXAMPLE, "--nvme-path", str(tmp_path / "swap"), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--loss-file", str(tmp_path / "losses")]
    script = worker_script("faulty_example")
    survivor = Torchrun([*elastic, "--rdzv-conf", f"is_host=1,{conf}"], script, args, tmp_path / "survivor.log")
    lost = Torchrun([*elastic, "--rdzv-conf", f"is_host=0,{conf}"], script, args, tmp_path / "lost.log",
                    ZINFTEST_KILL_STEP=str(KILL_STEP), ZINFTEST_KILL_AGENT="1")
    try:
        lost_code = lost.wait()
        output = _run_to_the_end(survivor)
    finally:
        lost.kill()
        survivor.kill()
    assert lost_code == -signal.SIGKILL, (lost_code, lost.output()[-3000:])
    assert re.search(r"resumed from \S+step-000003 at step 4, world 1 \(saved at world 2; torchrun restart 1\)",
                     output), output[-6000:]
    expected = _eager_losses(7, lambda step: 2 if step <= 3 else 1)
    losses = {step: float(loss) for step, loss in _losses(tmp_path / "losses").items()}
    assert sorted(losses) == list(range(1, 8))
    assert losses == pytest.approx(expected, rel=1e-5), (losses, expected)
