"""One rank of the collective-timeout test (launched by tests/multirank.py).

Both ranks train one step together; then only rank 0 calls full_state_dict,
a collective.  Rank 0 must get a ZinfCollectiveTimeout naming the call
within collective_timeout instead of hanging; rank 1 stays alive meanwhile.
Both then exit normally.
"""

import json
import os
import time

import torch
import torch.distributed as dist

import zinf_compiler as zinf
from zinf_compiler.runtime.comm import ZinfCollectiveTimeout

TIMEOUT_SECONDS = 3


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend="zinf",
                             options={"stage": 3, "lower": "eager", "collective_timeout": TIMEOUT_SECONDS})
    opt = zinf.optim.SGD(model.parameters(), lr=0.1)
    compiled(torch.randn(4, 8)).sum().backward()
    opt.step()
    result = {}
    if rank == 0:
        started = time.monotonic()
        try:
            zinf.full_state_dict(model)
            result["error"] = None
        except ZinfCollectiveTimeout as err:
            result["error"], result["message"] = type(err).__name__, str(err)
        result["seconds"] = time.monotonic() - started
    else:
        time.sleep(4 * TIMEOUT_SECONDS)  # alive but never joining: the hang the timeout must end
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(result, out)
    # After the timeout the process must still be able to exit normally (issue 25, point 6): tear down
    # the process group and return (run_ranks fails on a rank that hangs here).
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
