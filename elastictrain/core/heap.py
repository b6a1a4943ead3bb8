"""The heap that start-up built, left out of the garbage collector's full passes while the run trains.

A worker's start-up (torch, the model, the run's objects) leaves a few hundred thousand long-lived
objects. CPython runs a full collection, which visits every one of them, once the objects that
survived younger collections since the last full one reach a quarter of those: a start-up's
imports and restore build that debt, and it falls due at some step of the training. Here that
pass took 164-205 ms on a rank whose step is ~2 ms (~300,000 objects: the peers wait for it in
the next all-reduce), and it grows with the heap. ``gc.freeze()`` moves every object alive at
that point out of the collector's generations, as Python's documentation suggests for a process
whose start-up heap lives as long as it does; the pass then visits only what training made
(2-3 ms in the same jobs: benchmarks/README.md, "the collector's full pass").

What the freeze keeps: garbage in a reference cycle at the moment of the freeze is never
collected while frozen, so the restore leaves none behind it (its store calls and the loop
position the watchdog reads used to: every caller's frame, and its locals, lived on). ``release``
(the session's end) gives every frozen object back to the collector.

A process that manages its collector itself (``gc.disable()``, or a ``gc.freeze()`` of its own
before the session) is left alone.
"""

from __future__ import annotations

import gc


class SetupHeap:
    """``freeze()`` once training starts (the end of RESTORE); ``release()`` as the session ends."""

    def __init__(self) -> None:
        self.frozen = False

    def freeze(self) -> None:
        if self.frozen or not gc.isenabled() or gc.get_freeze_count():
            return
        gc.freeze()
        self.frozen = True

    def release(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False
