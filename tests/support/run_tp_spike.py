"""Spike launcher: python tests/support/run_tp_spike.py '{"mesh": "dp"}' -> prints each rank's result."""
import json
import sys

from multirank import run_ranks

results = run_ranks(4, "tp_worker", json.loads(sys.argv[1]), timeout=600)
for result in results:
    print(json.dumps({k: v for k, v in result.items() if k not in ("eager_params", "zinf_params", "eager_full", "zinf_full", "trace")})[:1500])
print(results[0].get("trace", "")[-int(sys.argv[2]) if len(sys.argv) > 2 else -2500:])
import torch
for result in results:
    if "zinf_params" in result:
        diffs = {name: (torch.tensor(result["zinf_params"][name]) - torch.tensor(value)).abs().max().item()
                 for name, value in result["eager_params"].items()}
        print("rank", result["rank"], "max |zinf - eager| per param:", diffs)
        full = {name: (torch.tensor(result["zinf_full"][name]) - torch.tensor(value)).abs().max().item()
                for name, value in result["eager_full"].items()}
        print("rank", result["rank"], "full_state_dict max |zinf - eager full_tensor()|:", full)
