"""zinf across a zoo of tiny Hugging Face causal LMs: equal to eager, and what a step costs beside eager's.

    python benchmarks/hf_zoo.py [--only llama,mixtral]

For each of the 21 architectures of ``tests/integration/test_hf_zoo.py`` (configs in code,
nothing downloaded; the default test run covers 12 of them, the other 9 are
marked slow there and run here): the same check as the test (stage 3,
parameters and optimizer state on NVMe, ``activation_checkpointing="block"``,
3 AdamW steps beside eager: losses and parameters within the equivalence
tolerances, one recompute region per decoder layer), then the step times of
the steps after the first (compilation) for eager and zinf, as a ratio.  The
models are tiny (2 layers, width 32): the ratio is zinf's fixed cost per step
(offload, checkpointing, the runtime), not a speed claim.  Exits non-zero if
any architecture fails its check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "integration"), os.path.join(HERE, "..", "tests", "support")]


def main() -> int:
    import pytest
    import torch

    import zinf_compiler as zinf
    import test_hf_zoo as zoo

    zinf.register()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated model types (default: all 21)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else [*zoo.ARCHITECTURES, *zoo.MORE_ARCHITECTURES]
    print(f"torch {torch.__version__}, transformers {zoo.transformers.__version__}; {len(names)} architectures\n")
    print("| architecture | in the default test run | losses (eager, zinf) | worst parameter error | eager step (s) "
          "| zinf step (s) | zinf / eager |")
    print("|---|---|---|---|---|---|---|")
    failed = []
    for name in names:
        monkeypatch = pytest.MonkeyPatch()
        try:
            with tempfile.TemporaryDirectory(prefix="zinf_zoo_") as nvme_path:
                plans = zoo.record_checkpoint_plans(monkeypatch)
                result = zoo.check_architecture(name, nvme_path, plans)
            eager = statistics.median(result["times"]["eager"])
            ours = statistics.median(result["times"]["zinf"])
            last = result["losses"][-1]
            print(f"| {name} | {'yes' if name in zoo.ARCHITECTURES else 'no (slow)'} | {last[0]:.5f}, {last[1]:.5f} "
                  f"| {result['worst_param_error']:.1e} | {eager:.4f} | {ours:.4f} | {ours / eager:.1f} |", flush=True)
        except Exception as err:  # an assertion of the check, or a crash: that architecture fails, the rest run
            failed.append(name)
            print(f"| {name} | FAILED: {type(err).__name__}: {str(err)[:200].replace('|', '/')} | | | | | |",
                  flush=True)
            traceback.print_exc(file=sys.stderr)
        finally:
            monkeypatch.undo()
            torch._dynamo.reset()
    print(f"\n{len(names) - len(failed)} of {len(names)} architectures equal eager with one block per layer"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
