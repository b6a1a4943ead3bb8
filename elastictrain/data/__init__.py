"""Resumable sharded sampling: global-sample positions that survive a new world size, per-sample seeds, batch geometry."""
