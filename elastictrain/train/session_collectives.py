"""The collectives a training loop calls through its session: every rank calls them, in the same order."""

from __future__ import annotations

from typing import Any

from elastictrain.dist.collectives import all_gather, all_reduce, broadcast_from_main
from elastictrain.dist.reduce import reduce_means
from elastictrain.train.call_order import CallOrder


class SessionCollectives:
    """``session.all_reduce``, ``all_gather``, ``broadcast`` and ``reduce_metrics``: over the session's process
    group, once it is up (a call before SETUP or after the ``with`` block is one ``UsageError``), each bounded by
    ``dist.collective_timeout_s``."""

    _calls: CallOrder

    def all_reduce(self, value: Any, op: str = "sum") -> Any:
        """``value`` (a tensor or a number) reduced over all ranks: ``op`` is sum, max, min or mean."""
        return all_reduce(value, op, self._calls.context("session.all_reduce()"))

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (any picklable object), in rank order, on every rank."""
        return all_gather(obj, self._calls.context("session.all_gather()"))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (any picklable object) on every rank."""
        return broadcast_from_main(obj, self._calls.context("session.broadcast()"), src)

    def reduce_metrics(self, metrics: dict[str, float], weight: float = 1) -> dict[str, float]:
        """Means over all ranks of this rank's ``metrics`` (its own means), each rank weighted by ``weight`` (its
        sample count): what ``evaluate_with``'s function returns. A rank may lack a name (it saw no sample)."""
        return reduce_means(metrics, weight, self._calls.context("session.reduce_metrics()"))
