"""Where the repository and the worker scripts are, for tests that start processes.

Worker scripts (tests/workers/) run as ``python tests/workers/NAME.py``: their own folder is then first
on ``sys.path``; the helpers here (tests/support/) reach them through ``PYTHONPATH`` (see :func:`worker_env`).
"""

from __future__ import annotations

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"
WORKERS = REPO / "tests" / "workers"


def worker_script(name: str) -> str:
    """The path of ``tests/workers/<name>.py``."""
    return str(WORKERS / f"{name}.py")


def worker_env(**extra: str) -> dict:
    """This process's environment, with tests/support/ on ``PYTHONPATH`` and ``extra`` set."""
    path = os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    return dict(os.environ, PYTHONPATH=path, **extra)
