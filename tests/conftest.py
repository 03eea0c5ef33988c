import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# One Inductor cache for the whole suite (and across runs): a cold Inductor
# compile costs 10-30 s per graph on 2 cores.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))

import torch  # noqa: E402  (after the cache dir is set)

# The folder a test file sits in is its tier (see tests/README.md): `pytest -m unit` runs one tier.
TIERS = ("unit", "integration", "multirank")


def pytest_collection_modifyitems(items):
    tests = REPO / "tests"
    for item in items:
        tier = item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else None
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no cached frames or guards from the last one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
