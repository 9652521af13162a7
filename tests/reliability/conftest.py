"""Reliability tests: faults, fuzzing and security. Hypothesis runs a small, fixed set of examples by default
(`HYPOTHESIS_PROFILE=deep` for a long search), and keeps no example database in the repository."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

# a failing example is reported as found (with its reproduce blob), not shrunk: shrinking can take minutes
settings.register_profile(
    "llmops", max_examples=8, deadline=None, derandomize=True, database=None, print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
settings.register_profile("deep", parent=settings.get_profile("llmops"), max_examples=400, derandomize=False,
                          phases=list(Phase))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "llmops"))
