"""Spike launcher: python tests/support/run_tp_spike.py '{"mesh": "dp"}' -> prints each rank's result."""
import json
import sys

from multirank import run_ranks

results = run_ranks(4, "tp_worker", json.loads(sys.argv[1]), timeout=600)
for result in results:
    print(json.dumps({k: v for k, v in result.items() if k not in ("eager_grads", "zinf_grads", "trace")})[:1500])
print(results[0].get("trace", "")[-int(sys.argv[2]) if len(sys.argv) > 2 else -2500:])
