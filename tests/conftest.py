import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# One Inductor cache for the whole suite (and across runs): a cold Inductor
# compile costs 10-30 s per graph on 2 cores.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))
# Inductor compiles its kernels in a pool of worker processes when it has more than one core: on
# parallel test workers (run_tests.sh) every process of the suite that compiles (each test worker, each
# rank, each helper) would start one, importing torch again (~3 s of CPU each), on cores the test
# workers already keep busy. The kernels are the same either way; measured on 2 cores, the default run
# took 6 min 37 s with one thread instead of 7 min 9 s. (In one process, e.g. on a GPU, the pool stays.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402  (after the cache dir is set)

# The folder a test file sits in is its tier (see tests/README.md): `pytest -m unit` runs one tier.
TIERS = ("unit", "integration", "multirank")


def pytest_collection_modifyitems(items):
    tests = REPO / "tests"
    for item in items:
        tier = item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else None
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
    # The multirank tier first: on parallel workers its tests are one unit of work (below), the longest,
    # started while the other workers take the files (run_tests.sh keeps this order: --no-loadscope-reorder).
    items.sort(key=lambda item: not item.get_closest_marker("multirank"))


@pytest.hookimpl(optionalhook=True)  # (a hook of pytest-xdist: without it installed, never called)
def pytest_xdist_make_scheduler(config, log):
    """run_tests.sh runs the suite on parallel workers (pytest-xdist, ``--dist loadfile``): a file's tests
    stay on one worker (its module fixtures are made once), and here the whole multirank tier is one unit,
    run by one worker, one launch at a time (two launches of ranks at once would crowd the cores several
    times over).  Other ``--dist`` modes are pytest-xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndTheMultirankTier(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/multirank" if path.startswith("tests/multirank/") else path

    return FilesAndTheMultirankTier(config, log)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no cached frames or guards from the last one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
