"""Who holds generation, and for how long: the weight-update and pause state machine.

Two things stop generation from outside: an open weight update (/start_weight_update until
/finish_weight_update) and a pause (/pause until /resume). Both are leases: each has an owner
(the client's `client_id` field, else its address) and expires `lease_s` seconds after it was
taken or last renewed, so a trainer that dies mid-update cannot hold the server forever. Every
transition runs under one lock:

    closed --start(owner)--> open(owner) --finish--> closed
    open(owner) --start(owner)--> open(owner), lease renewed (idempotent)
    open(owner) --start(other)--> refused (409) while the lease runs
    open(owner) --lease expires--> closed (the update's pending tensors dropped, logged)

A pause is renewed by another /pause (from anyone: pausing is idempotent) and ends at /resume or
when its lease expires.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from grpoflow.server.batcher import Batcher
from grpoflow.server.errors import RequestError

logger = logging.getLogger("grpoflow.server")

Expire = Callable[["Lease", float], None]
"""Called by a lease's timer with the lease and the expiry it was armed for."""


@dataclass(slots=True)
class Lease:
    """One hold's owner and when it ends."""

    owner: str
    expires: float
    timer: asyncio.TimerHandle | None = None

    def remaining(self) -> float:
        return max(0.0, self.expires - time.monotonic())


class Holds:
    """The open weight update and the pause of one server, over its batcher's gate."""

    def __init__(self, batcher: Batcher, lease_s: float, on_update_expired: Callable[[], None]) -> None:
        self.batcher, self.lease_s = batcher, lease_s
        self.on_update_expired = on_update_expired
        self.update: Lease | None = None
        self.pause_lease: Lease | None = None
        self._lock = asyncio.Lock()

    @property
    def update_open(self) -> bool:
        return self.update is not None

    # -- weight updates -------------------------------------------------------------------------

    async def start_update(self, owner: str) -> bool:
        """Open an update for `owner` (holding generation once the running batch ends); True when
        newly opened, False when `owner` already held it (its lease renewed)."""
        async with self._lock:
            if self.update is not None:
                if self.update.owner != owner:
                    raise RequestError(
                        f"a weight update is already open for another client ({self.update.owner}); it "
                        f"ends at its /finish_weight_update or in {self.update.remaining():.0f}s when its "
                        f"lease expires",
                        409,
                    )
                self._renew(self.update, self._expire_update)
                return False
            await self.batcher.hold()
            self.update = self._lease(owner, self._expire_update)
            return True

    def renew_update(self) -> None:
        """Extend the open update's lease (each /update_weights inside it does)."""
        if self.update is not None:
            self._renew(self.update, self._expire_update)

    async def finish_update(self) -> bool:
        """Close the open update and release generation; False when none was open."""
        async with self._lock:
            return await self._close_update()

    async def _close_update(self) -> bool:
        if self.update is None:
            return False
        _cancel(self.update)
        self.update = None
        await self.batcher.release()
        return True

    def _expire_update(self, lease: Lease, expires: float) -> None:
        async def expire() -> None:
            async with self._lock:
                if self.update is lease and lease.expires == expires:
                    logger.warning(
                        "the weight update opened by %s expired after %.0fs without /finish_weight_update; "
                        "generation resumes and its unapplied tensors are dropped",
                        self.update.owner,
                        self.lease_s,
                    )
                    self.on_update_expired()
                    await self._close_update()

        asyncio.get_running_loop().create_task(expire())

    # -- pause --------------------------------------------------------------------------------

    async def pause(self, mode: str, owner: str) -> None:
        """Pause generation (or renew the pause) for `lease_s` seconds."""
        async with self._lock:
            if self.pause_lease is None:
                self.pause_lease = self._lease(owner, self._expire_pause)
            else:
                self.pause_lease.owner = owner
                self._renew(self.pause_lease, self._expire_pause)
        await self.batcher.pause(mode)

    async def resume(self) -> None:
        async with self._lock:
            if self.pause_lease is not None:
                _cancel(self.pause_lease)
                self.pause_lease = None
            await self.batcher.resume()

    def _expire_pause(self, lease: Lease, expires: float) -> None:
        async def expire() -> None:
            async with self._lock:
                if self.pause_lease is lease and lease.expires == expires:
                    logger.warning(
                        "the pause taken by %s expired after %.0fs without /resume; generation resumes",
                        self.pause_lease.owner,
                        self.lease_s,
                    )
                    self.pause_lease = None
                    await self.batcher.resume()

        asyncio.get_running_loop().create_task(expire())

    # -- leases -------------------------------------------------------------------------------

    def _lease(self, owner: str, expire: Expire) -> Lease:
        lease = Lease(owner, 0.0)
        self._renew(lease, expire)
        return lease

    def _renew(self, lease: Lease, expire: Expire) -> None:
        """Restart the lease; a timer armed before this renewal finds `expires` changed and
        does nothing."""
        _cancel(lease)
        lease.expires = time.monotonic() + self.lease_s
        lease.timer = asyncio.get_running_loop().call_later(self.lease_s, expire, lease, lease.expires)

    def status(self) -> dict:
        """For /server_info: who holds generation and for how much longer."""
        return {
            "update_open": self.update_open,
            "update_owner": self.update.owner if self.update else None,
            "update_lease_remaining_s": round(self.update.remaining(), 1) if self.update else None,
            "pause_lease_remaining_s": round(self.pause_lease.remaining(), 1) if self.pause_lease else None,
        }


def _cancel(lease: Lease) -> None:
    if lease.timer is not None:
        lease.timer.cancel()
        lease.timer = None
