"""One rank of the tiling end-to-end test (launched by tests/support/multirank.py from test_tile_e2e.py).

Trains the GPT of ``zero_worker`` (eager reference on rank 0) under each
configuration and adds to each result the tile layout the store adopted for
every parameter of that model.
"""

import json
import os


from zero_worker import train
from zinf_compiler.gpt import GPTConfig
from zinf_compiler.api import RUNTIME
from multirank import finish_rank, start_rank


def main() -> None:
    args, world, rank = start_rank()
    cfg = GPTConfig(**args["model"], frozen_scale=True)
    results = []
    for config in args["configs"]:
        adopted_before = {record.uid for record in RUNTIME.store.records()}
        RUNTIME.store.reset_peak()  # this configuration's peak, not the previous one's
        result = train(config, cfg, world, rank, args["steps"], args["batch"])
        result["tile_rows"] = {record.name: record.tile_rows for record in RUNTIME.store.records()
                               if record.uid not in adopted_before}
        result["peak_transient_device"] = RUNTIME.store.peak_transient["device"]
        results.append(result)
    with open(os.environ["ZINFTEST_OUT"], "w") as handle:
        json.dump(results, handle)
    finish_rank()


if __name__ == "__main__":
    main()
