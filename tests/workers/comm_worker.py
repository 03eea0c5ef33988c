"""One rank of tests/multirank/test_comm.py: zinf's Comm collectives against torch.distributed's own.

On gloo, ``Comm.all_gather_into`` and ``Comm.reduce_scatter_avg`` run as one
broadcast or reduce per rank, and ``Comm.fill_slices`` fills a tensor's
slices in place; each result must equal what ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` (average) give, for every size and dtype drawn by
the test, on the default group and on a subgroup of ranks.  A rank that
never joins must still end in ZinfCollectiveTimeout within the timeout.
"""

import json
import os
import time

import torch
import torch.distributed as dist

from multirank import finish_rank, start_rank, wait_for_rank
from zinf_compiler.runtime.comm import ZinfCollectiveTimeout
from zinf_compiler.api import RUNTIME

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_group(comm, group, case: dict) -> dict:
    """This rank's differences between zinf's and torch's results for one (slice size, dtype) case."""
    world, rank = comm.world_size, comm.rank
    dtype = DTYPES[case["dtype"]]
    slice_numel = case["slice_numel"]
    generator = torch.Generator().manual_seed(case["seed"] * 100 + dist.get_rank())
    # Integer-valued data: sums and averages over up to 4 ranks are exact in every dtype, so zinf's
    # and torch's results must be equal, not close.
    local = torch.randint(-8, 8, (slice_numel,), generator=generator).to(dtype)
    full = torch.randint(-8, 8, (slice_numel * world,), generator=generator).to(dtype)

    gathered, expected = torch.empty(slice_numel * world, dtype=dtype), torch.empty(slice_numel * world, dtype=dtype)
    comm.all_gather_into(gathered, local, "test all_gather").wait()
    dist.all_gather_into_tensor(expected, local, group=group)
    result = {"all_gather": (gathered - expected).abs().max().item()}

    reduced, expected_slice = torch.empty(slice_numel, dtype=dtype), torch.empty(slice_numel, dtype=dtype)
    sum_input = full.clone()
    comm.reduce_scatter_avg(reduced, full.clone(), "test reduce_scatter").wait()
    dist.reduce_scatter_tensor(expected_slice, sum_input, op=dist.ReduceOp.SUM, group=group)
    result["reduce_scatter"] = (reduced - expected_slice / world).abs().max().item()

    # fill_slices: a tensor shorter than world x slice (the last rank's slice cut short), filled in place.
    numel = max(slice_numel * world - case["short_by"], 1)
    target = torch.full((numel,), 99, dtype=dtype)
    comm.fill_slices(target, local, "test fill").wait()
    result["fill_slices"] = (target - expected[:numel]).abs().max().item()
    return result


def main() -> None:
    args, world, rank = start_rank()
    comm = RUNTIME.comm
    results = {"rooted": comm.rooted_collectives, "cases": []}
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
    for case in args["cases"]:
        results["cases"].append({"world": check_group(comm, None, case)})
        if halves:
            group = halves[rank // 2]
            results["cases"][-1]["half"] = check_group(comm.subgroup(group), group, case)
    # A collective one rank never joins: the other's wait ends within its timeout, naming the call.
    if rank == 0:
        started = time.monotonic()
        try:
            comm.all_gather_into(torch.empty(8 * world), torch.ones(8), "the lonely gather", timeout=2).wait()
        except ZinfCollectiveTimeout as err:
            results["timeout"] = {"message": str(err), "seconds": time.monotonic() - started}
    else:
        wait_for_rank(0, 30)  # alive but never joining
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(results, out)
    finish_rank()


if __name__ == "__main__":
    main()
