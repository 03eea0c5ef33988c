"""zinf's collectives on gloo next to gloo's own (runtime/comm.py), same run, same tensors.

    python benchmarks/collectives.py [--world-sizes 2,4 --sizes-mib 186,27,4 --rounds 6]

Launches each world size as gloo ranks on localhost (one process and one
compute thread each) and times, on rank 0 between barriers, the median of
``--rounds`` calls of:

* all-gather: ``dist.all_gather_into_tensor`` vs ``Comm.all_gather_into``
  (on gloo: one broadcast from each rank into its row);
* reduce-scatter (average): ``dist.reduce_scatter_tensor`` vs
  ``Comm.reduce_scatter_avg`` (on gloo: one reduce onto each rank's slice);
* the stage 1-2 refresh of the example GPT's parameters (6 layers, width 768,
  fp32): gathered in buckets of one block and copied out into each parameter
  (what zinf did before) vs ``Comm.fill_slices`` straight into the parameters
  at least 1 MiB big (``REFRESH_IN_PLACE_BYTES``), the small rest bucketed.

Every zinf result is checked equal to gloo's before its time is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--sizes-mib", default="186,27,4", help="full tensor sizes (fp32) for the two collectives")
    parser.add_argument("--rounds", type=int, default=6)
    return parser.parse_args()


def _timed(fn, rounds: int) -> float:
    import torch.distributed as dist

    fn()
    seconds = []
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        fn()
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from zinf_compiler.gpt import GPT, GPTConfig
    from zinf_compiler.api import RUNTIME
    from zinf_compiler.runtime.store_publish import REFRESH_IN_PLACE_BYTES

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank, comm = dist.get_world_size(), dist.get_rank(), RUNTIME.comm
    rows = []
    for mib in (float(size) for size in args.sizes_mib.split(",")):
        slice_numel = int(mib * 2**20 / 4) // world
        local = torch.randn(slice_numel)
        full = torch.randn(slice_numel * world)
        ours, theirs = torch.empty(slice_numel * world), torch.empty(slice_numel * world)
        native = _timed(lambda: dist.all_gather_into_tensor(theirs, local), args.rounds)
        zinf = _timed(lambda: comm.all_gather_into(ours, local).wait(), args.rounds)
        assert torch.equal(ours, theirs)
        rows.append(("all-gather", mib, native, zinf))
        ours, theirs = torch.empty(slice_numel), torch.empty(slice_numel)
        native = _timed(lambda: dist.reduce_scatter_tensor(theirs, full.clone(), op=dist.ReduceOp.AVG), args.rounds)
        zinf = _timed(lambda: comm.reduce_scatter_avg(ours, full.clone()).wait(), args.rounds)
        torch.testing.assert_close(ours, theirs)
        rows.append(("reduce-scatter (avg)", mib, native, zinf))

    # The stage 1-2 refresh: every parameter rebuilt from each rank's slice of it.
    torch.manual_seed(0)
    named = list(GPT(GPTConfig(n_layer=6, n_embd=768, n_head=12, vocab_size=8192)).named_parameters())
    params = [param.detach() for _, param in named]
    slices = [torch.randn(-(-p.numel() // world)) for p in params]
    blocks: dict[str, list[int]] = {}  # zinf's default buckets: one per transformer block
    for index, (name, _) in enumerate(named):
        blocks.setdefault(".".join(name.split(".")[:2]) if name.startswith("blocks.") else name, []).append(index)

    def bucketed(indices) -> None:
        """One all-gather per bucket of (indices) into a rank-major matrix, then each parameter copied out."""
        columns = sum(slices[i].numel() for i in indices)
        matrix = torch.empty(world * columns)
        dist.all_gather_into_tensor(matrix, torch.cat([slices[i] for i in indices]))
        at = 0
        for i in indices:
            width = slices[i].numel()
            params[i].view(-1).copy_(matrix.view(world, columns)[:, at : at + width].reshape(-1)[: params[i].numel()])
            at += width

    def before() -> None:
        for indices in blocks.values():
            bucketed(indices)

    def after() -> None:
        big = [i for i, p in enumerate(params) if p.numel() * 4 >= REFRESH_IN_PLACE_BYTES]
        works = [comm.fill_slices(params[i].view(-1), slices[i]) for i in big]
        for indices in blocks.values():
            rest = [i for i in indices if i not in big]
            if rest:
                bucketed(rest)
        for work in works:
            work.wait()

    before()
    expected = [p.clone() for p in params]
    for p in params:
        p.zero_()
    after()
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    total_mib = sum(p.numel() for p in params) * 4 / 2**20
    rows.append(("stage 1-2 refresh of the GPT", total_mib, _timed(before, args.rounds), _timed(after, args.rounds)))
    if rank == 0:
        with open(os.environ["COLLECTIVES_OUT"], "w") as out:
            json.dump(rows, out)
    dist.destroy_process_group()


def _launch(world: int) -> list:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rows.json")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
                                  env=dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port), COLLECTIVES_OUT=out, OMP_NUM_THREADS="1",
                                           PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                                           PYTHONWARNINGS="ignore"))
                 for rank in range(world)]
        codes = [proc.wait(timeout=1800) for proc in procs]
        if any(codes):
            raise SystemExit(f"world {world}: ranks exited with {codes}")
        with open(out) as handle:
            return json.load(handle)


def main() -> int:
    args = _parse()
    if "COLLECTIVES_OUT" in os.environ:
        _worker(args)
        return 0
    import torch

    print(f"command: python benchmarks/collectives.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average at start "
          f"{', '.join(f'{v:.2f}' for v in os.getloadavg())}\n")
    print("| world | collective | MiB | gloo's own (ms) | zinf's (ms) | speed-up |")
    print("|---|---|---|---|---|---|")
    for world in (int(w) for w in args.world_sizes.split(",")):
        for name, mib, native, zinf in _launch(world):
            print(f"| {world} | {name} | {mib:.1f} | {native * 1e3:.1f} | {zinf * 1e3:.1f} | {native / zinf:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
