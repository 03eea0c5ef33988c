"""examples/train_gpt.py with a fault: a worker (or its whole node) SIGKILLed in the middle of a training step.

torchrun runs this in place of the example, with the example's arguments.
On the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), at optimizer
step ``ZINFTEST_KILL_STEP`` (after that step's forward, backward and
gradient clipping, before the update), the worker of rank
``ZINFTEST_KILL_RANK`` (every rank this agent runs if unset) SIGKILLs
itself; with ``ZINFTEST_KILL_AGENT=1`` it first SIGKILLs its parent, the
torchrun agent, as when a machine of an elastic job disappears.
"""

import os
import signal
import sys

from torch.optim.optimizer import register_optimizer_step_pre_hook

from zinf_compiler.optim import ZinfOptimizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import train_gpt  # noqa: E402


def _kill_at_step(step: int) -> None:
    steps_taken = 0

    def before_update(optimizer, args, kwargs):
        nonlocal steps_taken
        if not isinstance(optimizer, ZinfOptimizer):
            return  # the optimizer zinf's steps the shards with (a global hook sees it too)
        steps_taken += 1
        if steps_taken == step:
            print(f"faulty_example: rank {os.environ['RANK']} SIGKILLs itself in step {step}", flush=True)
            if os.environ.get("ZINFTEST_KILL_AGENT") == "1":
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_pre_hook(before_update)


if __name__ == "__main__":
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    this_rank = os.environ.get("ZINFTEST_KILL_RANK") in (None, os.environ.get("RANK"))
    if "ZINFTEST_KILL_STEP" in os.environ and first_attempt and this_rank:
        _kill_at_step(int(os.environ["ZINFTEST_KILL_STEP"]))
    sys.exit(train_gpt.main(sys.argv[1:]))
