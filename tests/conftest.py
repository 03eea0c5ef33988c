import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# One Inductor cache for the whole suite (and across runs): a cold Inductor
# compile costs 10-30 s per graph on 2 cores.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))
# Inductor compiles its C++ kernels in a pool of worker processes when it has more than one core:
# every process of the suite that compiles (the test workers, each rank, each helper) would start
# one, importing torch again (~3 s of CPU each), on cores the test workers already keep busy
# (run_tests.sh runs them in parallel). The kernels are the same either way; measured on 2 cores,
# the default run took 6 min 37 s with one thread instead of 7 min 9 s.
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
        # run_tests.sh runs the suite on parallel workers (pytest-xdist, --dist loadgroup): a file's
        # tests stay on one worker (its module fixtures are made once), and the multirank tier runs on
        # one worker, one launch at a time (its ranks would otherwise crowd the cores several times over).
        item.add_marker(pytest.mark.xdist_group("multirank" if tier == "multirank" else str(item.path)))
    # The multirank tier first: the longest group, started while the other workers take the files.
    items.sort(key=lambda item: not item.get_closest_marker("multirank"))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no cached frames or guards from the last one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
