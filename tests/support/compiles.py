"""Watching zinf compile: how many Dynamo graphs it compiled, and which shape guards its own code installed."""

from __future__ import annotations

import os
import pathlib

import torch

import zinf_compiler as zinf
import zinf_compiler.passes as zinf_passes
import zinf_compiler.runtime as zinf_runtime

# zinf's own source folders (the package, its passes and its runtime), wherever they were imported from.
ZINF_FOLDERS = tuple(str(pathlib.Path(module.__file__).resolve().parent) + os.sep
                     for module in (zinf, zinf_passes, zinf_runtime))


class CompileRecorder:
    """Counts zinf's compiles (one per Dynamo graph) around the real backend, and keeps each one's ShapeEnv,
    whose ``guards`` (every guard on a symbolic size, a specialization to a constant too) record the frame
    that installed them."""

    def __init__(self, monkeypatch):
        from zinf_compiler import backend

        self.compiles = 0
        self._envs = []
        real = backend.compile_captured

        def recording(*args, **kwargs):
            self.compiles += 1
            tracing = torch._guards.TracingContext.try_get()
            if tracing is not None and tracing.fake_mode.shape_env is not None:
                self._envs.append(tracing.fake_mode.shape_env)
            return real(*args, **kwargs)

        monkeypatch.setattr(backend, "compile_captured", recording)

    def guards_by_zinf(self) -> list[str]:
        """The guards a zinf source file installed, as ``expr  (file:line in function)``."""
        return self.guards_installed_in(ZINF_FOLDERS)

    def guards_installed_in(self, prefixes: tuple[str, ...]) -> list[str]:
        """The guards installed by code in files whose path starts with one of ``prefixes``."""
        found = []
        for env in self._envs:
            for guard in env.guards:
                frame = guard.sloc.framework_loc
                filename = getattr(frame, "filename", None) or (frame if isinstance(frame, str) else "")
                if filename and str(pathlib.Path(filename).resolve()).startswith(prefixes):
                    found.append(f"{guard.expr}  ({filename}:{getattr(frame, 'lineno', '?')} "
                                 f"in {getattr(frame, 'name', '?')})")
        return found
