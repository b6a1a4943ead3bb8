"""Whose store this is: the run id kept in it, and the lease that keeps two runs from writing it.

``StoreLease`` reads and writes the lease object of one store; ``lease_keeper.LeaseKeeper``
holds it for a job on rank 0 and renews it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid

from elastictrain.core.errors import StoreLeaseError
from elastictrain.storage.commit import write_small_object
from elastictrain.storage.store_client import StoreClient

LEASE_NAME = ".lease.json"
RUN_ID_NAME = ".run-id"  # the run this store belongs to: node-local copies are kept under it (snapshot/local_tier.py)

log = logging.getLogger("elastictrain.storage.snapshot_store")


def run_id(client: StoreClient) -> str:
    """The id of the run this store belongs to: created by its first start (before any snapshot), then read back.

    A node-local copy is kept under it, so a copy is restored only into the run whose durable
    store it belongs to: not into a run that reuses the name with another (or an emptied) store.
    """
    with client.operation(f"cannot read or write the run id of snapshot store {client.url}"):
        try:
            found = client.call("cat_file", client.path(RUN_ID_NAME)).decode("utf-8", "replace").strip()
        except FileNotFoundError:
            found = None
        if found is not None and len(found) == 32 and all(c in "0123456789abcdef" for c in found):
            return found
        if found is not None:  # another id would only disown this run's node-local copies, never adopt others'
            log.warning("the run id %s is unreadable; this run gets a new one", client.where(RUN_ID_NAME))
        new_id = uuid.uuid4().hex
        write_small_object(client, RUN_ID_NAME, new_id.encode())
        return new_id


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, it is just not ours
    return True


class StoreLease:
    """The lease object ``<root>/.lease.json`` of one store: take it, renew it, release it."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self._lease: dict | None = None

    def acquire(self, owner: dict, stale_after_s: float) -> None:
        """Take the store's lease for this run, or raise StoreLeaseError naming the live run that holds it.

        ``owner`` has ``run_id``, ``token`` (shared by every attempt of one job), ``host``, ``pid``
        and ``started_unix``; the lease object ``<root>/.lease.json`` adds ``renewed_unix``.
        Taken if there is none, if it carries the same token (this job, restarted), or if it is
        stale: renewed more than ``stale_after_s`` ago, or held by a process on this host that is
        gone. ``stale_after_s == 0`` disables the lease (acquire, renew and release do nothing).

        Guarantees, and their limits: the other run's lease is never modified or deleted unless
        stale. Timestamps are the writer's wall clock (``time.time()``), so hosts whose clocks
        differ by more than a fraction of ``stale_after_s`` can misjudge staleness. The store has
        no compare-and-swap here: two runs starting within one round trip of each other can both
        write; the read-back after the write makes the later writer win and the earlier one see
        a foreign token and raise, which narrows but does not close that window.
        """
        missing = {"run_id", "token", "host", "pid", "started_unix"} - set(owner)
        if missing:
            raise ValueError(f"lease owner lacks {sorted(missing)}")
        if stale_after_s <= 0:
            self._lease = None
            return
        with self.client.operation(f"cannot take the lease of snapshot store {self.client.url}"):
            current = self._read()
            if current is not None and current.get("token") != owner["token"]:
                stale_because = self._stale_because(current, stale_after_s)
                if stale_because is None:
                    raise StoreLeaseError(self._held_message(current, stale_after_s))
                log.warning(
                    "taking over the stale lease of snapshot store %s from run %s (%s)",
                    self.client.url,
                    current.get("run_id"),
                    stale_because,
                )
            record = {name: owner[name] for name in ("run_id", "token", "host", "pid", "started_unix")}
            record["renewed_unix"] = time.time()
            self._write(record)
            written = self._read()
            if written is None or written.get("token") != record["token"]:
                raise StoreLeaseError(self._held_message(written or {}, stale_after_s, lost_race=True))
            self._lease = record

    def renew(self) -> None:
        """Refresh ``renewed_unix`` of the lease this store holds; StoreLeaseError if another run took it over."""
        if self._lease is None:
            return
        with self.client.operation(f"cannot renew the lease of snapshot store {self.client.url}"):
            current = self._read()
            if current is not None and current.get("token") != self._lease["token"]:
                raise StoreLeaseError(
                    f"the lease of snapshot store {self.client.url} was taken over by run {current.get('run_id')} "
                    f"(host {current.get('host')}, pid {current.get('pid')}) after this run's lease went stale; "
                    "this run must stop writing snapshots there"
                )
            record = {**self._lease, "renewed_unix": time.time()}
            self._write(record)
            self._lease = record

    def release(self) -> None:
        """Delete the lease if this run still holds it; another run's lease is left alone."""
        if self._lease is None:
            return
        token, self._lease = self._lease["token"], None
        with self.client.operation(f"cannot release the lease of snapshot store {self.client.url}"):
            current = self._read()
            if current is not None and current.get("token") == token:
                self.client.call("rm", self.client.path(LEASE_NAME))

    def _read(self) -> dict | None:
        try:
            data = self.client.call("cat_file", self.client.path(LEASE_NAME))
        except FileNotFoundError:
            return None
        try:
            record = json.loads(data.decode("utf-8"))
        except ValueError:
            record = None
        if not isinstance(record, dict):
            log.warning("the lease object %s is unreadable; treating it as stale", self.client.where(LEASE_NAME))
            return {"run_id": "unknown (unreadable lease)", "renewed_unix": 0.0}
        return record

    def _write(self, record: dict) -> None:
        write_small_object(self.client, LEASE_NAME, json.dumps(record, sort_keys=True).encode("utf-8"))

    @staticmethod
    def _stale_because(record: dict, stale_after_s: float) -> str | None:
        try:
            age_s = time.time() - float(record.get("renewed_unix", 0.0))
        except (TypeError, ValueError):
            return "its renewal time is unreadable"
        if age_s > stale_after_s:
            return f"last renewed {age_s:.0f} s ago, stale after {stale_after_s:g} s"
        pid = record.get("pid")
        if record.get("host") == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            return f"its process {pid} on this host is gone"
        return None

    def _held_message(self, record: dict, stale_after_s: float, lost_race: bool = False) -> str:
        try:
            age = f"{time.time() - float(record['renewed_unix']):.0f} s ago"
        except (KeyError, TypeError, ValueError):
            age = "at an unknown time"
        how = "took it at the same moment" if lost_race else "holds it"
        return self.client.scrub(
            f"snapshot store {self.client.url} is in use: run {record.get('run_id')} (host {record.get('host')}, "
            f"pid {record.get('pid')}, last renewed {age}) {how}, and two runs must not write one store; wait for "
            f"it to finish (its lease goes stale {stale_after_s:g} s after its last renewal), use another "
            "snapshot.durable.url, or set snapshot.durable.lease_stale_after_s=0 to disable the lease"
        )
