"""Triton kernels for what Inductor cannot build from a graph: they run inside the runtime, not in one.

* :func:`adamw_step_` - one fused AdamW step over a flat fp32 master shard,
  its gradient and moments, writing the updated parameter back in the
  compute dtype (bf16/fp16/fp32) in the same pass: the device optimizer
  tier reads each element once instead of once per torch kernel, and no
  separate cast-and-copy of the master into the shard follows.
* :func:`cast_copy_` - a shard (any float dtype) cast and copied into its
  slice of a gather buffer in one pass.

The math is ``torch.optim.AdamW``'s (decoupled weight decay, bias
corrections, ``eps`` added after the square root), computed in fp32.

On a GPU the kernels compile for it; on the CPU they run under Triton's
interpreter (``TRITON_INTERPRET=1`` set before this module is imported),
which is how CI tests them against torch references.  Importing this module
needs ``triton``; nothing else in the runtime imports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _round(value, dtype: tl.constexpr):
    """``value`` in ``dtype``, rounded to nearest even as torch's ``.to()`` rounds.

    To bf16 the rounding is spelled out on the fp32 bits: Triton's interpreter
    truncates that conversion, and the kernel must mean the same on both.
    """
    if dtype == tl.bfloat16:
        bits = value.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return value.to(dtype)


@triton.jit
def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, numel,
                  lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
                  WRITE_OUT: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < numel
    master = tl.load(master_ptr + offsets, mask=mask)
    grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
    master = master * (1.0 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
    denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
    master = master - (lr / bias_correction1) * (exp_avg / denom)
    tl.store(master_ptr + offsets, master, mask=mask)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
    if WRITE_OUT:
        tl.store(out_ptr + offsets, _round(master, out_ptr.dtype.element_ty), mask=mask)


def adamw_step_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 1e-2, out: torch.Tensor | None = None) -> None:
    """One AdamW step in place on flat fp32 ``master`` and moments; ``out``: the parameter in compute dtype.

    ``step`` counts from 1 (the step being taken), as ``torch.optim.AdamW``'s state does after it.
    """
    numel = master.numel()
    tensors = [master, grad, exp_avg, exp_avg_sq] + ([out] if out is not None else [])
    for tensor in tensors:
        if tensor.numel() != numel or not tensor.is_contiguous() or tensor.device != master.device:
            raise ValueError("adamw_step_ takes contiguous flat tensors of one size on one device")
    for tensor in (master, exp_avg, exp_avg_sq):
        if tensor.dtype != torch.float32:
            raise ValueError(f"adamw_step_ steps fp32 masters and moments, got {tensor.dtype}")
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if numel == 0:
        return
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2_sqrt = (1.0 - beta2 ** step) ** 0.5
    _adamw_kernel[(triton.cdiv(numel, BLOCK),)](
        master, grad, exp_avg, exp_avg_sq, out if out is not None else master, numel,
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), bias_correction1,
        bias_correction2_sqrt, WRITE_OUT=out is not None, BLOCK_SIZE=BLOCK)


@triton.jit
def _cast_copy_kernel(dst_ptr, src_ptr, numel, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < numel
    value = tl.load(src_ptr + offsets, mask=mask)
    tl.store(dst_ptr + offsets, _round(value, dst_ptr.dtype.element_ty), mask=mask)


def cast_copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for flat contiguous tensors of one size, casting on the way, in one kernel."""
    if dst.numel() != src.numel() or not dst.is_contiguous() or not src.is_contiguous():
        raise ValueError("cast_copy_ takes contiguous tensors of one size")
    if dst.device != src.device:
        raise ValueError(f"cast_copy_ copies within one device, got {src.device} -> {dst.device}")
    if dst.numel():
        _cast_copy_kernel[(triton.cdiv(dst.numel(), BLOCK),)](
            dst, src, dst.numel(), BLOCK_SIZE=BLOCK)
    return dst
