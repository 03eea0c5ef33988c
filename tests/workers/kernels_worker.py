"""Check the Triton kernels (runtime/kernels.py) against torch on one device; run by test_kernels.py.

``python kernels_worker.py cpu`` runs under Triton's interpreter (the parent
sets TRITON_INTERPRET=1); ``cuda`` compiles for the GPU.  Prints one JSON
object: the largest errors against the torch reference.
"""

from __future__ import annotations

import json
import sys

import torch

from zinf_compiler.runtime import kernels


def adamw_errors(device: str, numel: int, out_dtype, steps: int = 4) -> dict:
    generator = torch.Generator().manual_seed(numel)
    start = torch.randn(numel, generator=generator)
    grads = [torch.randn(numel, generator=generator) * 0.1 for _ in range(steps)]
    hyper = dict(lr=3e-3, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.05)
    reference = torch.nn.Parameter(start.clone())
    torch_opt = torch.optim.AdamW([reference], foreach=False, **hyper)
    master = start.clone().to(device)
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    out = torch.empty(numel, dtype=out_dtype, device=device)
    for step, grad in enumerate(grads, start=1):
        reference.grad = grad.clone()
        torch_opt.step()
        kernels.adamw_step_(master, grad.to(device), exp_avg, exp_avg_sq, step, lr=hyper["lr"],
                            beta1=hyper["betas"][0], beta2=hyper["betas"][1], eps=hyper["eps"],
                            weight_decay=hyper["weight_decay"], out=out)
    state = torch_opt.state[reference]
    scale = reference.detach().abs().max().item()
    return {
        "master": (master.cpu() - reference.detach()).abs().max().item() / scale,
        "exp_avg": (exp_avg.cpu() - state["exp_avg"]).abs().max().item() / state["exp_avg"].abs().max().item(),
        "exp_avg_sq": ((exp_avg_sq.cpu() - state["exp_avg_sq"]).abs().max().item()
                       / state["exp_avg_sq"].abs().max().item()),
        # The written-back parameter is exactly the master rounded to its dtype.
        "out_exact": bool(torch.equal(out.cpu(), master.cpu().to(out_dtype))),
        "moved": (master.cpu() - start).abs().max().item() > 0,
    }


def main() -> None:
    device = sys.argv[1]
    results = {}
    for numel in (1, 1000, 3 * kernels.BLOCK + 7):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            results[f"adamw {numel} {dtype}"] = adamw_errors(device, numel, dtype)
    for src_dtype, dst_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                 (torch.float16, torch.bfloat16), (torch.float32, torch.float32)):
        src = (torch.randn(2 * kernels.BLOCK + 5, generator=torch.Generator().manual_seed(1)) * 3).to(src_dtype)
        dst = torch.full((src.numel(),), float("nan"), dtype=dst_dtype, device=device)
        kernels.cast_copy_(dst, src.to(device))
        results[f"cast {src_dtype} -> {dst_dtype}"] = {"exact": bool(torch.equal(dst.cpu(), src.to(dst_dtype)))}
    results["refusals"] = refusals()
    print(json.dumps(results))


def refusals() -> list[str]:
    """Bad arguments raise ValueError naming the problem: the messages, or what did not raise."""
    master = torch.zeros(8)
    calls = {
        "sizes": lambda: kernels.adamw_step_(master, torch.zeros(7), torch.zeros(8), torch.zeros(8), 1, lr=1e-3),
        "fp32": lambda: kernels.adamw_step_(master, torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16),
                                            torch.zeros(8), 1, lr=1e-3),
        "step": lambda: kernels.adamw_step_(master, torch.zeros(8), torch.zeros(8), torch.zeros(8), 0, lr=1e-3),
        "cast sizes": lambda: kernels.cast_copy_(torch.zeros(3), torch.zeros(4)),
    }
    messages = []
    for name, call in calls.items():
        try:
            call()
            messages.append(f"{name}: did not raise")
        except ValueError as err:
            messages.append(str(err))
    return messages


if __name__ == "__main__":
    main()
