"""torchrun rendezvous backends that let a node join a running job: ``elastictrain-c10d``, ``elastictrain-etcd-v2``.

Each is torch's own backend (``c10d``, ``etcd-v2``) with one fix. In torch 2.13 the dynamic
rendezvous hands workers a store that the rank-0 agent hosts, and tells the other agents where it is
through two keys of the round, ``torch.rendezvous.<id>.<round>/MASTER_ADDR`` and ``MASTER_PORT``. An
agent writes them only the first time it builds that store and then keeps its address, so in every
later round the keys are missing: an agent that joins a running job (a node started again after it
was lost) waits for them until the store times out (measured: ``DistStoreError: wait timeout after
60000ms, keys: /torch.rendezvous.<id>.2/MASTER_ADDR``), its torchrun exits, and the survivor times
out waiting for it in turn. Here the rank-0 agent publishes the address in every round, and every
other agent reads it from that round, so a rank 0 that changed between rounds is followed too.

``elastictrain-c10d`` also takes fractions of a second where torch reads whole ones
(``RendezvousParameters.get_as_int``): ``keep_alive_interval``, ``last_call_timeout``,
``join_timeout``, ``close_timeout`` and ``heartbeat_timeout`` in ``--rdzv-conf``
(``keep_alive_interval=0.5``), so a lost node is declared dead and the smaller round closed in
about a second and a half instead of torch's whole-second floor (``timing_of``, pure; the handler is
torch's own ``DynamicRendezvousHandler``, built as torch's ``create_handler`` builds it).

torchrun finds these backends through the ``torchrun.handlers`` entry points in pyproject.toml, once
elastictrain is installed where torchrun runs: ``torchrun --rdzv-backend=elastictrain-c10d ...``.
Everything else (flags, the other ``--rdzv-conf`` keys, the store's host) is the wrapped backend's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from elastictrain.core.errors import ConfigError

Creator = Callable[[RendezvousParameters], RendezvousHandler]

# torch's defaults (dynamic_rendezvous.py): keep-alive every 5 s, dead after 3 missed; the timeouts' own defaults
# are RendezvousTimeout's, used where a key is not given.
KEEP_ALIVE_INTERVAL_S = 5.0
KEEP_ALIVE_MAX_ATTEMPT = 3
TIMEOUTS = ("join", "last_call", "close", "heartbeat")
TIMING_KEYS = (*(f"{name}_timeout" for name in TIMEOUTS), "keep_alive_interval", "keep_alive_max_attempt")


@dataclass(frozen=True)
class Timing:
    """The c10d rendezvous's timing from ``--rdzv-conf``, in seconds (None: torch's default)."""

    timeouts: dict[str, float | None]  # join, last_call, close, heartbeat
    keep_alive_interval_s: float = KEEP_ALIVE_INTERVAL_S
    keep_alive_max_attempt: int = KEEP_ALIVE_MAX_ATTEMPT


def timing_of(config: Mapping[str, object]) -> Timing:
    """The rendezvous's timing from ``--rdzv-conf``'s keys (strings from the command line, or numbers): every
    duration a positive number of seconds, fractions allowed; ``keep_alive_max_attempt`` a whole number >= 1.
    ConfigError otherwise (the handler's creator says it in one line and ends torchrun with exit 2)."""

    def seconds(key: str) -> float | None:
        value = config.get(key)
        if value is None:
            return None
        try:
            number = float(value)  # type: ignore[arg-type]  # a str or a number, as torchrun passes it
        except (TypeError, ValueError):
            number = float("nan")
        if not number > 0 or number == float("inf"):
            raise ConfigError(f"--rdzv-conf {key}={value}: give a positive number of seconds, e.g. {key}=0.5")
        return number

    attempts = config.get("keep_alive_max_attempt", KEEP_ALIVE_MAX_ATTEMPT)
    if not str(attempts).isdigit() or int(str(attempts)) < 1:
        raise ConfigError(f"--rdzv-conf keep_alive_max_attempt={attempts}: give a whole number of heartbeats, e.g. 3")
    interval = seconds("keep_alive_interval")
    return Timing(
        {name: seconds(f"{name}_timeout") for name in TIMEOUTS},
        KEEP_ALIVE_INTERVAL_S if interval is None else interval,
        int(str(attempts)),
    )


class RoundPublishingHandler(RendezvousHandler):
    """Delegates to torch's handler; publishes (rank 0) or reads (others) the workers' store address every round."""

    def __init__(self, inner: RendezvousHandler, backend: str) -> None:
        self._inner = inner
        self._backend = backend

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        if not self._inner.use_agent_store or info.bootstrap_store_info is None:
            return info  # the workers build a store of their own, announced afresh every round
        round_store = info.store  # prefixed with this round by torch
        if info.rank == 0:
            address = info.bootstrap_store_info
            # Store.set takes bytes too (torch's own rendezvous passes bytes); its stub says str only.
            round_store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, address.master_addr.encode())  # type: ignore[arg-type]
            round_store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(address.master_port).encode())  # type: ignore[arg-type]
        else:
            address = RendezvousStoreInfo(
                round_store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode(),
                int(round_store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode()),
            )
        return RendezvousInfo(info.store, info.rank, info.world_size, address)

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def get_backend(self) -> str:
        return self._backend

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _wrapping(torch_backend: str) -> Creator:
    def create(params: RendezvousParameters) -> RendezvousHandler:
        inner = rendezvous_handler_registry.create_handler(
            RendezvousParameters(
                torch_backend,
                params.endpoint,
                params.run_id,
                params.min_nodes,
                params.max_nodes,
                params.local_addr,
                **params.config,
            )
        )
        return RoundPublishingHandler(inner, f"elastictrain-{torch_backend}")

    return create


def _c10d(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d handler as its ``create_handler`` builds it, with ``timing_of``'s durations (fractions kept)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    try:
        timing = timing_of(params.config)
    except ConfigError as exc:  # torchrun would print it with its traceback
        print(f"elastictrain: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None
    rest = {key: value for key, value in params.config.items() if key not in TIMING_KEYS}
    torch_params = RendezvousParameters(
        "c10d", params.endpoint, params.run_id, params.min_nodes, params.max_nodes, params.local_addr, **rest
    )
    backend, store = create_backend(torch_params)
    durations = {name: None if s is None else timedelta(seconds=s) for name, s in timing.timeouts.items()}
    inner = DynamicRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        RendezvousTimeout(**durations),
        # torch's signature says int; it makes a timedelta of it, which takes a fraction of a second too
        keep_alive_interval=timing.keep_alive_interval_s,  # type: ignore[arg-type]
        keep_alive_max_attempt=timing.keep_alive_max_attempt,
    )
    return RoundPublishingHandler(inner, "elastictrain-c10d")


# The torchrun.handlers entry points: each returns the creator torchrun registers under its name.
def c10d() -> Creator:
    return _c10d


def etcd_v2() -> Creator:
    return _wrapping("etcd-v2")
