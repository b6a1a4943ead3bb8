"""Exactly-once experiment tracking: TensorBoard and MLflow curves that never fork after a restart.

Rank 0 writes a history record to the trackers only once a snapshot covering its step has committed
(``snapshotted``, either tier), and at DONE. A restart resumes from a committed snapshot whose
history holds every record written so far, so what follows it is new; for the rarer restore from an
older snapshot (the newest one lost with its node) each tracker reports what it already stores, per
name, and those points are skipped: every (name, step) is written once. See docs/guides/tracking.md.
"""
