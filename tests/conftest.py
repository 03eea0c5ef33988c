import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# One Inductor cache for the whole suite (and across runs): a cold Inductor
# compile costs 10-30 s per graph on 2 cores.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))

import torch  # noqa: E402  (after the cache dir is set)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no cached frames or guards from the last one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
