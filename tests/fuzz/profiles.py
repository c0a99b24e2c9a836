"""Hypothesis settings of the fuzz tests.

FUZZ_PROFILE=ci (the default, what `make test` runs): derandomized (a fixed seed per test),
no example database, no shrinking (a failure stops the test at once and its kernel file is
written as found), 30 cases per family. FUZZ_PROFILE=fuzz (`make fuzz`): random, with the
example database (earlier failures are replayed first) and shrinking, 500 cases per family.
FUZZ_EXAMPLES=N sets the cases of every family, FUZZ_EXAMPLES_<FAMILY>=N of one (e.g.
FUZZ_EXAMPLES_ATTENTION); FUZZ_SHRINK=1 shrinks under the ci profile too. FUZZ_TIMEOUT (s,
default 90) bounds each case; FUZZ_LOG=FILE appends a JSON line per case. FUZZ_SURVEY=1 (for
campaigns: hypothesis stops generating soon after its first failures) runs every case of the
profile, keeps the smallest kernel of each failure signature unshrunk, and fails at the end
(see harness.fuzz_test). FUZZ_AVOID=tag,... is read by the strategies (programs/writer.py).
FUZZ_ROUTE=torch.compile compiles each case through torch.compile(backend="lighthouse")
instead of the kernel-file driver (child.py); test_torch_compile_route.py does so for a few
cases per family (FUZZ_EXAMPLES_<FAMILY>_ROUTE=N, default 4 under ci, 100 under fuzz).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

PROFILE = os.environ.get("FUZZ_PROFILE", "ci")
DEFAULT_EXAMPLES = {"ci": 30, "fuzz": 500}
if PROFILE not in DEFAULT_EXAMPLES:
    raise ValueError(f"FUZZ_PROFILE={PROFILE!r}: profiles are {', '.join(DEFAULT_EXAMPLES)}")


def examples(family: str, defaults: dict | None = None) -> int:
    value = os.environ.get(f"FUZZ_EXAMPLES_{family.upper()}", os.environ.get("FUZZ_EXAMPLES"))
    return int(value) if value else (defaults or DEFAULT_EXAMPLES)[PROFILE]


def fuzz_settings(family: str, defaults: dict | None = None) -> settings:
    common = dict(max_examples=examples(family, defaults), deadline=None, print_blob=True,
                  suppress_health_check=list(HealthCheck))
    if PROFILE == "fuzz":
        return settings(**common)
    phases = [Phase.explicit, Phase.generate]
    if os.environ.get("FUZZ_SHRINK") == "1":
        phases.append(Phase.shrink)
    return settings(derandomize=True, database=None, phases=phases, **common)
