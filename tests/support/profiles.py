"""The hypothesis profiles of the property tests that compile (one drawn case compiles a model: seconds each).

quick (the default): 3 drawn cases per property; ci: 8 (run_tests.sh --all sets HYPOTHESIS_PROFILE=ci); thorough:
60 (``HYPOTHESIS_PROFILE=thorough``).  Registered once here, for every file that loads them: a profile is
process-wide, so two files registering their own would change each other's.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SLOW_CASES = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]

settings.register_profile("quick", max_examples=3, deadline=None, derandomize=True, suppress_health_check=_SLOW_CASES)
settings.register_profile("ci", max_examples=8, deadline=None, derandomize=True, suppress_health_check=_SLOW_CASES)
settings.register_profile("thorough", max_examples=60, deadline=None, suppress_health_check=_SLOW_CASES)


def load() -> None:
    """Load the profile HYPOTHESIS_PROFILE names (default quick)."""
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "quick"))
