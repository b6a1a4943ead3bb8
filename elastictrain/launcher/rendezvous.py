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

torchrun finds these backends through the ``torchrun.handlers`` entry points in pyproject.toml, once
elastictrain is installed where torchrun runs: ``torchrun --rdzv-backend=elastictrain-c10d ...``.
Everything else (flags, ``--rdzv-conf``, the store's host) is the wrapped backend's.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.elastic.rendezvous.api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

Creator = Callable[[RendezvousParameters], RendezvousHandler]


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


# The torchrun.handlers entry points: each returns the creator torchrun registers under its name.
def c10d() -> Creator:
    return _wrapping("c10d")


def etcd_v2() -> Creator:
    return _wrapping("etcd-v2")
