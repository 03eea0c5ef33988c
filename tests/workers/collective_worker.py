"""One rank of the collective-timeout tests (launched by tests/support/multirank.py).

Both ranks compile and train one step of each model in ``timeouts`` (one
small model per entry, compiled with that ``collective_timeout``, in order);
then only rank 0 calls full_state_dict of the first model, a collective rank
1 never joins.  Rank 0 must get a ZinfCollectiveTimeout naming the call
within the first model's own timeout instead of hanging (before issue 27 the
process's one timeout was the last compile's); rank 1 stays alive meanwhile.
Both then exit normally.
"""

import json
import os
import time

import torch
import torch.distributed as dist

import zinf_compiler as zinf
from multirank import finish_rank, wait_for_rank
from zinf_compiler.runtime.comm import ZinfCollectiveTimeout


def build(timeout: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend="zinf",
                             options={"stage": 3, "lower": "eager", "collective_timeout": timeout})
    return model, compiled, zinf.optim.SGD(model.parameters(), lr=0.1)


def main() -> None:
    timeouts = json.loads(os.environ.get("ZINFTEST_ARGS", "{}")).get("timeouts", [3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    models = [build(timeout) for timeout in timeouts]
    for _, compiled, opt in models:
        compiled(torch.randn(4, 8)).sum().backward()
        opt.step()
    result = {}
    if rank == 0:
        started = time.monotonic()
        try:
            zinf.full_state_dict(models[0][0])
            result["error"] = None
        except ZinfCollectiveTimeout as err:
            result["error"], result["message"] = type(err).__name__, str(err)
        result["seconds"] = time.monotonic() - started
    else:
        wait_for_rank(0, 4 * timeouts[0])  # alive but never joining: the hang the timeout must end
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(result, out)
    # After the timeout the process must still be able to exit normally (issue 25, point 6): tear down
    # the process group and return (run_ranks fails on a rank that hangs here).
    finish_rank()


if __name__ == "__main__":
    main()
