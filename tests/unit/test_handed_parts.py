"""The runtime's parts as handed in (issue 36): a resting parameter's link to its store, swap folder watches.

No compile, no process group: the pieces runtime-inject changed, tested alone.
"""

from __future__ import annotations

import copy
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import torch

from adopting import adopt_in

from zinf_compiler.api import RUNTIME
from zinf_compiler.runtime.resting import RestingParameter, _StoreLink, record_of
from zinf_compiler.runtime.store import ParamStore


def test_a_resting_parameter_finds_its_record_through_its_own_store():
    store = ParamStore(RUNTIME.comm)
    param = torch.nn.Parameter(torch.randn(8, 4))
    record = adopt_in(store, param, "w", stage=3, partition="allgather", param_dtype="fp32")
    assert record_of(param) == (None, None)  # not resting yet: no link
    store.release_full_storage([record])
    assert type(param) is RestingParameter
    assert record_of(param) == (store, record)
    assert RUNTIME.store.lookup(param) is None  # another store: never asked
    with torch.no_grad():
        param.copy_(torch.ones(8, 4))  # the guard writes through the linked store
    assert torch.equal(store.full_param(record), torch.ones(8, 4))


def test_the_store_link_pickles_and_copies_as_nothing_of_the_store():
    store = ParamStore(RUNTIME.comm)
    link = _StoreLink(store)
    assert link.store() is store
    assert pickle.loads(pickle.dumps(link)).store() is None  # the store never travels
    assert copy.deepcopy(link) is link


def test_a_second_folder_watch_removes_its_folders_and_the_first_ones_on_sigterm(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    script = textwrap.dedent(f"""
        import os, signal
        from zinf_compiler.runtime.swap_folders import FolderWatch
        a, b = FolderWatch(), FolderWatch()
        a.watch(object(), {str(first)!r})  # (the owner only names the entry)
        b.watch(object(), {str(second)!r})
        os.kill(os.getpid(), signal.SIGTERM)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert not os.path.exists(first) and not os.path.exists(second)
