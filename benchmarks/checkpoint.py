"""Checkpoint cost: zinf.save / zinf.load / zinf.export next to torch.save / torch.load of the same model.

    python benchmarks/checkpoint.py                      # GPT of ~85M parameters, states on NVMe
    python benchmarks/checkpoint.py --n-layer 4 --n-embd 256 --smoke

The zinf side trains one step with parameters and optimizer state on NVMe
(the model built by ``zinf.materialize``), then saves, loads and exports.
The baseline is eager PyTorch with the same model and ``torch.optim.AdamW``
after one step: ``torch.save({"model": ..., "optim": ...})`` and
``torch.load`` + ``load_state_dict``.  Each call is measured over its own
peak-RSS window (``/proc/self/clear_refs``): the growth of RSS above what
the process held before the call.  Wall times are noisy on a shared machine;
compare the ratios printed on the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import torch

import zinf_compiler as zinf
from zinf_compiler.gpt import GPT, GPTConfig, synthetic_batches
from zinf_compiler.runtime.host_memory import new_peak_window, rss_figures


def measured(call):
    """(seconds, peak RSS growth in bytes) of ``call()``."""
    before = new_peak_window()
    started = time.perf_counter()
    call()
    return time.perf_counter() - started, rss_figures()["VmHWM"] - before


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dir", default=None, help="where checkpoints and swap files go (default: a temp folder)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.n_layer, args.n_embd, args.vocab = 2, 128, 512
    work = tempfile.mkdtemp(dir=args.dir)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=64, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    idx, targets = synthetic_batches(cfg, 2, 1)[0]
    results = {}
    try:
        # --- zinf, states on NVMe ---
        options = {"stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
                   "nvme_path": os.path.join(work, "swap"), "lower": "eager"}
        os.makedirs(options["nvme_path"])
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(cfg)
        zinf.materialize(model, options, init_fn=model.init_weights, progress=False)
        params = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() for p in model.parameters()) * 4
        compiled = torch.compile(model, backend="zinf", options=options)
        opt = zinf.optim.AdamW(model.parameters(), lr=1e-3)
        compiled(idx, targets).backward()
        opt.step()
        opt.zero_grad()
        path = os.path.join(work, "zinf-ckpt")
        results["zinf save"] = measured(lambda: zinf.save(path, compiled, opt))
        results["zinf save"] += (folder_bytes(path),)
        results["zinf load"] = measured(lambda: zinf.load(path, compiled, opt)) + (0,)
        export = os.path.join(work, "export")
        results["zinf export"] = measured(lambda: zinf.export(export, compiled)) + (folder_bytes(export),)
        del compiled, model, opt
        # --- eager baseline ---
        torch.manual_seed(0)
        eager = GPT(cfg)
        eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
        eager(idx, targets).backward()
        eager_opt.step()
        eager_opt.zero_grad()
        file = os.path.join(work, "torch.pt")
        results["torch.save"] = measured(lambda: torch.save({"model": eager.state_dict(),
                                                             "optim": eager_opt.state_dict()}, file))
        results["torch.save"] += (os.path.getsize(file),)

        def torch_load():
            state = torch.load(file)
            eager.load_state_dict(state["model"])
            eager_opt.load_state_dict(state["optim"])

        results["torch.load"] = measured(torch_load) + (0,)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"GPT {params / 1e6:.1f}M parameters ({params * 16 / 2**20:.0f} MiB of fp32 model states with Adam), "
          f"largest parameter {largest / 2**20:.1f} MiB")
    print(f"{'call':<12} {'seconds':>8} {'peak RSS growth':>16} {'bytes on disk':>14}")
    for name, (seconds, rss, nbytes) in results.items():
        print(f"{name:<12} {seconds:>8.2f} {rss / 2**20:>12.1f} MiB {nbytes / 2**20:>10.1f} MiB")
    # RSS: eager keeps all its model states resident (so torch.save adds little); zinf's rest on NVMe.
    print(f"ratios: save {results['zinf save'][0] / results['torch.save'][0]:.2f}x torch.save's time, "
          f"load {results['zinf load'][0] / results['torch.load'][0]:.2f}x torch.load's; eager holds "
          f"{params * 16 / 2**20:.0f} MiB of states resident throughout, zinf's save and load add at most "
          f"{max(results['zinf save'][1], results['zinf load'][1]) / 2**20:.0f} MiB to RSS")
    print(json.dumps({"params": params, "largest_param_bytes": largest,
                      **{name: dict(seconds=s, peak_rss_growth=r, disk_bytes=b) for name, (s, r, b) in
                         results.items()}}))


if __name__ == "__main__":
    main()
