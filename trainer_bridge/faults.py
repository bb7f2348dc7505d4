"""Crash points for fault injection: the delivery tests kill the bridge at exact places.

`ROLLTAP_CRASH_AT=POINT:N` makes the process SIGKILL itself the Nth time it reaches POINT (no
`finally`, no atexit: a real crash). Unset, a crash point costs one dictionary lookup. The points
are the seams of exactly-once delivery: `after_claim` (a group is leased, nothing released),
`after_put` (samples are on the trainer's queue), `during_step` (a micro-batch is being trained),
`after_step` (the optimizer stepped, the delivery is not acknowledged yet), `after_log` (the step
is in the delivery log, its checkpoint not written yet) and `after_announce` (a push is announced,
the engines are still paused).

`ROLLTAP_STOP_AT=POINT:N` sends the process SIGTERM there instead, the stop a user or an
orchestrator sends: the tests of a stopped bridge stop it at the exact moment they are about.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

POINTS = ("after_claim", "after_put", "during_step", "after_step", "after_log", "after_announce")
_hits: Counter = Counter()


_SIGNALS = {"ROLLTAP_CRASH_AT": signal.SIGKILL, "ROLLTAP_STOP_AT": signal.SIGTERM}


def crash_point(name: str) -> None:
    hit = False
    for variable, signum in _SIGNALS.items():
        spec = os.environ.get(variable)
        if not spec:
            continue
        point, _, nth = spec.partition(":")
        if point != name:
            continue
        if not hit:
            _hits[name] += 1
            hit = True
        if _hits[name] == int(nth or 1):
            os.kill(os.getpid(), signum)
