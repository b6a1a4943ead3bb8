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
torch's own ``DynamicRendezvousHandler``, built as torch's ``create_handler`` builds it). And it reads
the round's state every ``poll_interval`` seconds (0.1 by default) where torch reads it once a second:
an agent waiting for a round to open or close sleeps a whole second between reads, and serves the
agent's monitor a state up to a second old, so every restart of a two-node group paid ~1 s in the
rendezvous alone (measured: both agents in the round 38.57 s, round complete 39.66 s; a one-node
group, which never waits, restarts in 0.4 s). ``PollingOpExecutor`` is torch's operation executor
with that wait shortened; the state holder's cache is shortened to match. Both are torch's private
parts, checked by type where they are swapped: a torch that moved them keeps its one-second poll,
said once in a warning.

An agent that exits on a signal (a node preempted: SIGTERM to its torchrun) leaves its round on the
way out (``leave_round_at_exit``). torchrun does not shut the handler down then, rightly (that would
close the rendezvous for every node), so the leaving node stayed a participant until its heartbeat
went stale (``keep_alive_interval × keep_alive_max_attempt``), and the others' next round waited for
that: 2.0 s of a preempted node's 2.8 s. Leaving is torch's own exit operation, the one every agent
runs before it joins a new round.

torchrun finds these backends through the ``torchrun.handlers`` entry points in pyproject.toml, once
elastictrain is installed where torchrun runs: ``torchrun --rdzv-backend=elastictrain-c10d ...``.
Everything else (flags, the other ``--rdzv-conf`` keys, the store's host) is the wrapped backend's.
"""

from __future__ import annotations

import atexit
import logging
import socket
import sys
import threading
import time
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
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # torch's private parts: poll_every, leave_round
    DynamicRendezvousHandler,
    RendezvousSettings,
    _Action,
    _BackendRendezvousStateHolder,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousStateHolder,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from elastictrain.core.errors import ConfigError
from elastictrain.launcher.join_warmup import warm_before_joining

log = logging.getLogger("elastictrain")

Creator = Callable[[RendezvousParameters], RendezvousHandler]

# torch's defaults (dynamic_rendezvous.py): keep-alive every 5 s, dead after 3 missed; the timeouts' own defaults
# are RendezvousTimeout's, used where a key is not given.
KEEP_ALIVE_INTERVAL_S = 5.0
KEEP_ALIVE_MAX_ATTEMPT = 3
DEFAULT_PORTS = {"c10d": 29400, "etcd-v2": 2379}  # torch's, for an endpoint given without one
LEAVE_WITHIN_S = 1.0  # an agent's exit waits this long at most to leave its round (a store gone: it cannot)
POLL_INTERVAL_S = 0.1  # torch: 1 s (its executor's wait between reads of the round, its state holder's cache)
TIMEOUTS = ("join", "last_call", "close", "heartbeat")
TIMING_KEYS = (
    *(f"{name}_timeout" for name in TIMEOUTS),
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "poll_interval",
)


@dataclass(frozen=True)
class Timing:
    """The c10d rendezvous's timing from ``--rdzv-conf``, in seconds (None: torch's default)."""

    timeouts: dict[str, float | None]  # join, last_call, close, heartbeat
    keep_alive_interval_s: float = KEEP_ALIVE_INTERVAL_S
    keep_alive_max_attempt: int = KEEP_ALIVE_MAX_ATTEMPT
    poll_interval_s: float = POLL_INTERVAL_S  # how often a waiting agent reads the round's state


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
    poll = seconds("poll_interval")
    return Timing(
        {name: seconds(f"{name}_timeout") for name in TIMEOUTS},
        KEEP_ALIVE_INTERVAL_S if interval is None else interval,
        int(str(attempts)),
        POLL_INTERVAL_S if poll is None else poll,
    )


class PollingOpExecutor(_DistributedRendezvousOpExecutor):
    """torch's rendezvous operation executor, reading the round's state every ``poll_s`` seconds while an
    operation waits for other agents (torch's ``_Action.SYNC``), where torch sleeps a whole second.

    Everything else is torch's loop: each read is the state holder's ``sync``, and the operation decides again
    from the state it returns, as torch's loop does after its own sleep."""

    def __init__(
        self,
        node: _NodeDesc,
        state_holder: _RendezvousStateHolder,
        settings: RendezvousSettings,
        poll_s: float,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(node, state_holder, settings)
        self._poll_s = poll_s
        self._sleep = sleep

    def run(
        self,
        state_handler: Callable[[_RendezvousContext, float], _Action],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        def polling(ctx: _RendezvousContext, deadline: float) -> _Action:
            action = state_handler(ctx, deadline)
            while action == _Action.SYNC:  # torch's loop would sleep a second here, then sync and ask again
                self._sleep(self._poll_s)
                self._state_holder.sync()
                self._state = self._state_holder.state
                action = state_handler(_RendezvousContext(self._node, self._state, self._settings), deadline)
            return action

        super().run(polling, deadline, update_deadline)


def poll_every(handler: RendezvousHandler, poll_s: float) -> bool:
    """Make torch's dynamic rendezvous ``handler`` read the round's state every ``poll_s`` seconds: its executor
    replaced by a ``PollingOpExecutor``, its state holder's cache shortened to ``poll_s``. False (torch's one-second
    poll kept, with a warning) when this torch's handler does not have those parts."""
    executor = getattr(handler, "_op_executor", None)
    holder = getattr(handler, "_state_holder", None)
    if type(executor) is not _DistributedRendezvousOpExecutor or not isinstance(holder, _BackendRendezvousStateHolder):
        log.warning(
            "elastictrain's rendezvous: this torch's handler has no executor or state holder where torch 2.13 has "
            "them; the round's state is read once a second, as torch does (restarts take ~1 s longer)"
        )
        return False
    holder._cache_duration = poll_s  # type: ignore[assignment]  # torch says int; it compares it with float times
    handler._op_executor = PollingOpExecutor(  # type: ignore[attr-defined]
        executor._node, holder, executor._settings, poll_s
    )
    return True


class RoundPublishingHandler(RendezvousHandler):
    """Delegates to torch's handler; publishes (rank 0) or reads (others) the workers' store address every round.
    Before its first round, a node joining a running job warms its workers' interpreter (join_warmup.py)."""

    def __init__(self, inner: RendezvousHandler, backend: str) -> None:
        self._inner = inner
        self._backend = backend
        self._joined = False
        self.shut_down = False  # torchrun called shutdown(): the job ended, or failed (leave_round_at_exit)

    @property
    def inner(self) -> RendezvousHandler:
        return self._inner

    def next_rendezvous(self) -> RendezvousInfo:
        if not self._joined:
            self._joined = True
            holder = getattr(self._inner, "_state_holder", None)
            if isinstance(holder, _BackendRendezvousStateHolder):
                holder.sync()
                warm_before_joining(holder.state, sys.argv[1:])
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
        self.shut_down = True
        return self._inner.shutdown()


def _wrapping(torch_backend: str) -> Creator:
    def create(params: RendezvousParameters) -> RendezvousHandler:
        poll_s = _timing(params.config).poll_interval_s  # the one key of ours; torch reads the rest its own way
        inner = rendezvous_handler_registry.create_handler(
            RendezvousParameters(
                torch_backend,
                params.endpoint,
                params.run_id,
                params.min_nodes,
                params.max_nodes,
                params.local_addr,
                **{key: value for key, value in params.config.items() if key != "poll_interval"},
            )
        )
        return _ours(inner, torch_backend, params.endpoint, poll_s)

    return create


def _timing(config: Mapping[str, object]) -> Timing:
    """``timing_of``, its ConfigError said in one line, ending torchrun with exit 2 (torchrun would print it with
    its traceback)."""
    try:
        return timing_of(config)
    except ConfigError as exc:
        print(f"elastictrain: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None


def _c10d(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d handler as its ``create_handler`` builds it, with ``timing_of``'s durations (fractions kept)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    timing = _timing(params.config)
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
    return _ours(inner, "c10d", params.endpoint, timing.poll_interval_s)


def _ours(inner: RendezvousHandler, torch_backend: str, endpoint: str, poll_s: float) -> RoundPublishingHandler:
    """torch's handler made ``elastictrain-<torch_backend>``: the round read every ``poll_s``, the store's address
    published every round, the round left at a signalled agent's exit."""
    poll_every(inner, poll_s)
    handler = RoundPublishingHandler(inner, f"elastictrain-{torch_backend}")
    leave_round_at_exit(handler, parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORTS[torch_backend]))
    return handler


def leave_round(handler: RendezvousHandler, within_s: float = LEAVE_WITHIN_S) -> bool:
    """Take this agent's node out of the round it is a participant of (torch's exit operation), its heartbeats
    stopped first; True once done. In a thread joined for ``within_s`` at most: at an agent's exit the store may be
    gone with the agent that hosted it, and nothing may hold the exit up."""
    if not isinstance(handler, DynamicRendezvousHandler):
        return False
    done = threading.Event()

    def leave() -> None:
        try:
            handler._stop_heartbeats()
            handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + within_s)
            done.set()
        except Exception as exc:  # noqa: BLE001 - a store gone or closed: the heartbeat's expiry does it instead
            log.debug("leaving the rendezvous round failed: %s", exc)

    thread = threading.Thread(target=leave, name="elastictrain-leave-round", daemon=True)
    thread.start()
    thread.join(within_s)
    return done.is_set()


def leave_round_at_exit(handler: RoundPublishingHandler, endpoint: tuple[str, int]) -> None:
    """Leave the round when the agent's process exits on a signal (``leave_round``). Not after torchrun shut the
    handler down (the job's end, or an error: torchrun did what there is to do), nor when nothing answers at the
    rendezvous ``endpoint`` (its host gone: the store's client would only print its C++ warnings)."""

    def leave() -> None:
        if not handler.shut_down and reachable(endpoint):
            leave_round(handler.inner)

    atexit.register(leave)


def reachable(endpoint: tuple[str, int], within_s: float = 0.5) -> bool:
    """Whether a TCP connection to ``endpoint`` (host, port) opens."""
    try:
        socket.create_connection(endpoint, timeout=within_s).close()
    except OSError:
        return False
    return True


# The torchrun.handlers entry points: each returns the creator torchrun registers under its name.
def c10d() -> Creator:
    return _c10d


def etcd_v2() -> Creator:
    return _wrapping("etcd-v2")
