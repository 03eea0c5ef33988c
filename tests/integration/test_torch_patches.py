"""zinf's changes to torch are one explicit install point (issue 27): nothing at import, idempotent, reversible.

zinf_compiler/torch_patches.py routes torch's gradient clipping,
``nn.Module.zero_grad`` and optimizer steps through guards that see zinf's
gradient shards.  Before, importing zinf patched all three as a side effect.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import zinf_compiler as zinf
from zinf_compiler import torch_patches
from zinf_compiler.api import RUNTIME


def _torch_state() -> dict:
    """What torch's patched entry points currently resolve to."""
    norm = torch.nn.utils.clip_grad.clip_grad_norm_
    cells = dict(zip(norm.__code__.co_freevars, norm.__closure__ or ()))
    return {"zero_grad": torch.nn.Module.zero_grad,
            "clip body": cells["func"].cell_contents if "func" in cells else norm,
            "step hooks": len(sys.modules["torch.optim.optimizer"]._global_optimizer_pre_hooks)}


def test_importing_zinf_changes_nothing_in_torch():
    script = textwrap.dedent("""
        import sys
        import torch
        from torch.nn.utils import clip_grad_norm_
        hooks = sys.modules["torch.optim.optimizer"]._global_optimizer_pre_hooks
        before = (torch.nn.Module.zero_grad, clip_grad_norm_.__closure__[0].cell_contents if clip_grad_norm_.__closure__
                  else clip_grad_norm_, len(hooks))
        import zinf_compiler
        after = (torch.nn.Module.zero_grad, clip_grad_norm_.__closure__[0].cell_contents if clip_grad_norm_.__closure__
                 else clip_grad_norm_, len(hooks))
        assert before == after, (before, after)
        import zinf_compiler.torch_patches
        assert not zinf_compiler.torch_patches.installed()
        print("unchanged")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "unchanged" in done.stdout, done.stderr[-3000:]


def test_install_is_idempotent_and_uninstall_restores_torch():
    was_installed = torch_patches.installed()
    torch_patches.uninstall()
    pristine = _torch_state()
    try:
        torch_patches.install(RUNTIME.store, RUNTIME.optimizers)
        patched = _torch_state()
        assert patched["zero_grad"] is torch_patches.module_zero_grad_with_shards
        assert patched["clip body"] is torch_patches.clip_grad_norm_
        assert patched["step hooks"] == pristine["step hooks"] + 1
        torch_patches.install(RUNTIME.store, RUNTIME.optimizers)
        assert _torch_state() == patched  # a second install changes nothing
        torch_patches.uninstall()
        assert _torch_state() == pristine
        torch_patches.uninstall()  # and a second uninstall neither
        assert _torch_state() == pristine
    finally:
        if was_installed:
            torch_patches.install(RUNTIME.store, RUNTIME.optimizers)


def test_a_compile_installs_the_guards_and_they_work_after_a_reinstall():
    torch_patches.uninstall()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    compiled = torch.compile(model, backend="zinf", options={"stage": 3, "lower": "eager"})
    compiled(torch.randn(3, 4)).sum().backward()
    assert torch_patches.installed()
    opt = zinf.optim.SGD(model.parameters(), lr=0.1)
    # The guard hands torch's clipping to the zinf optimizer (before: 0, nothing clipped).
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)) > 0
    torch_patches.uninstall()
    torch_patches.install(RUNTIME.store, RUNTIME.optimizers)
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)) > 0
    opt.step()
