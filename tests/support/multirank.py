"""Run a worker function on N local gloo ranks (separate processes) and collect its results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

from repo_paths import worker_env, worker_script


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(world_size: int, worker: str, args: dict, timeout: float = 600, killed_ok: bool = False) -> list:
    """Run ``python tests/workers/<worker>.py`` as ``world_size`` ranks; return each rank's JSON result.

    ``killed_ok``: ranks that SIGKILLed themselves (a crash test) are not
    failures; their result is None.  The port :func:`free_port` found may be
    taken by another process before rank 0 binds it: that failure alone is
    retried once, on a new port.
    """
    try:
        return _run_ranks(world_size, worker, args, timeout, killed_ok)
    except AssertionError as err:
        if "address already in use" not in str(err).lower():
            raise
        return _run_ranks(world_size, worker, args, timeout, killed_ok)


def _run_ranks(world_size: int, worker: str, args: dict, timeout: float, killed_ok: bool) -> list:
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        procs = []
        for rank in range(world_size):
            env = worker_env(
                RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                ZINFTEST_ARGS=json.dumps(args), ZINFTEST_OUT=os.path.join(folder, f"rank{rank}.json"),
                OMP_NUM_THREADS="1",
                TMPDIR=folder,
                # A rank that aborts prints every thread's Python stack; torch's deprecation
                # warnings would otherwise fill the log tail a failure shows.
                PYTHONFAULTHANDLER="1",
                PYTHONWARNINGS="ignore::FutureWarning",
            )
            log = open(os.path.join(folder, f"rank{rank}.log"), "w")
            procs.append((subprocess.Popen([sys.executable, worker_script(worker)], env=env,
                                           stdout=log, stderr=subprocess.STDOUT), log))
        failures = []
        for rank, (proc, log) in enumerate(procs):
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for other, _ in procs:
                    other.kill()
                code = "timeout"
            log.close()
            if code != 0 and not (killed_ok and code == -9):
                failures.append((rank, code))
        if failures:
            logs = "\n".join(
                f"--- rank {rank} (exit {code}, result "
                f"{'written' if os.path.exists(os.path.join(folder, f'rank{rank}.json')) else 'not written'}) ---\n"
                + open(os.path.join(folder, f"rank{rank}.log")).read()[-6000:]
                for rank, code in failures
            )
            raise AssertionError(f"ranks failed: {failures}\n{logs}")
        outs = [os.path.join(folder, f"rank{rank}.json") for rank in range(world_size)]
        return [json.load(open(out)) if os.path.exists(out) else None for out in outs]


def start_rank() -> tuple[dict, int, int]:
    """In a worker: its arguments (``ZINFTEST_ARGS``), the world size and its rank, the process group up."""
    import torch.distributed as dist

    args = json.loads(os.environ["ZINFTEST_ARGS"])
    world = int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo")
    return args, world, dist.get_rank() if world > 1 else 0


def record_error(result: dict, err: BaseException) -> None:
    """In a worker's ``except``: note ``err`` and its trace in ``result`` for the test to check and show."""
    import traceback

    result["error"] = f"{type(err).__name__}: {err}"[:3000]
    result["trace"] = traceback.format_exc()[-6000:]


def write_result(result: dict) -> None:
    """In a worker: ``result`` as this rank's output (what :func:`run_ranks` returns for it)."""
    with open(os.environ["ZINFTEST_OUT"], "w") as out:
        json.dump(result, out)


def wait_for_rank(rank: int, limit: float) -> None:
    """In a worker: stay alive until rank ``rank`` has written its result (at most ``limit`` seconds),
    e.g. while it waits out a collective this rank never joins."""
    import time

    result = os.path.join(os.path.dirname(os.environ["ZINFTEST_OUT"]), f"rank{rank}.json")
    deadline = time.monotonic() + limit
    while not os.path.exists(result) and time.monotonic() < deadline:
        time.sleep(0.05)


def finish_rank() -> None:
    """In a worker, last: collect garbage, then take the process group down.

    DDP's reducer and compiled graphs sit in reference cycles; left to the
    interpreter's final collection they are destroyed after
    ``destroy_process_group`` while the interpreter shuts down, and gloo work
    they hold may take the GIL then (a rare SIGABRT, "terminate called without
    an active exception", seen once in CI).  Collected here, they go first.
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
