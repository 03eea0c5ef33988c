"""One rank of the per-model collective_timeout test (issue 27; launched by tests/multirank.py).

Two models in one process, compiled with different collective_timeout: A
with 3 s first, then B with 120 s.  Both ranks train one step of each; then
only rank 0 calls full_state_dict(A), a collective rank 1 never joins.  A's
own timeout must end the wait (before, the process's one timeout was the
last compile's: B's 120 s).
"""

import json
import os
import time

import torch
import torch.distributed as dist

import zinf_compiler as zinf
from zinf_compiler.runtime.comm import ZinfCollectiveTimeout


def build(timeout: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend="zinf",
                             options={"stage": 3, "lower": "eager", "collective_timeout": timeout})
    return model, compiled, zinf.optim.SGD(model.parameters(), lr=0.1)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first, second = build(3), build(120)
    for model, compiled, opt in (first, second):
        compiled(torch.randn(4, 8)).sum().backward()
        opt.step()
    result = {}
    if rank == 0:
        started = time.monotonic()
        try:
            zinf.full_state_dict(first[0])
            result["error"] = None
        except ZinfCollectiveTimeout as err:
            result["error"], result["message"] = type(err).__name__, str(err)
        result["seconds"] = time.monotonic() - started
    else:
        time.sleep(12)  # alive but never joining
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(result, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
