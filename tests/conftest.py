"""Hypothesis profiles: `make test` explores a fixed, derandomized set of examples so CI is reproducible;
`make fuzz` runs the property tests again and again with fresh random seeds to find new failures."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HICACHE_HYPOTHESIS_PROFILE", "ci"))
