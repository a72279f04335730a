"""One exit-code table for every `dsv41` command (README "Exit codes" prints the same table; a
test checks they agree). The engine processes our installer stops at boot use 2 and 3 too."""
from __future__ import annotations

OK = 0          # done; every check held (gate: PASS)
FAILED = 1      # ran, and found a problem: an adapter not installed, outputs that differ, a pin
                # that drifted, a failed request (gate: KILL)
USAGE = 2       # could not run as asked: bad arguments, a missing or unreadable file, a bad
                # DSV41_* key, a run that cannot be judged or fitted
REFUSED = 3     # an adapter refused to install (pin drift, swan module missing or tampered):
                # the boot stops naming the key to unset
INVALID = 4     # gate: the controls disagree, so the candidate cannot be judged

TABLE = (
    (OK, "ok", "done; every check held (gate verdict: PASS)"),
    (FAILED, "failed", "ran and found a problem: an adapter not installed, outputs that differ, a "
                       "drifted pin, a failed request (gate verdict: KILL)"),
    (USAGE, "usage", "could not run as asked: bad arguments, a missing or unreadable file, a bad "
                     "DSV41_* key, a run that cannot be judged or fitted"),
    (REFUSED, "refused", "an adapter refused to install (pin drift, swan module missing or "
                         "tampered); also the exit code of an engine process our installer stops"),
    (INVALID, "invalid", "gate verdict INVALID: the controls disagree, the candidate cannot be judged"),
)
