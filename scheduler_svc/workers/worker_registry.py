"""Worker ranks that registered with this scheduler, gathered into groups.

A group is usable once all of its ranks have registered; the engine is handed it then, and
told when any of its ranks leaves (the rank's Register call ended or broke). A rank serving
another model or block size is refused at once, with the reason.

Everything a registration says is bounded and checked before anything is dialed (the worker
token was checked before the call reached us): registration on at all (RegistryConfig), the
address on the allow-list, field sizes, at most `max_pending` ranks waiting for their groups,
a group's name and size fixed by its first rank and closed once complete. A group that does
not complete within `join_timeout` is dropped and its ranks' calls ended, so that no name or
call is held for ever; one the engine refuses at its handshake is dropped the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from common.config import RegistryConfig
from common.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from common.worker_info import BLOCK_SIZES, MAX_NAME_LENGTH, MAX_WORLD_SIZE

log = structlog.get_logger(__name__)

MAX_ADDRESS_LENGTH = 512


@dataclass(frozen=True)
class Registration:
    address: str
    group: str
    rank: int
    world_size: int
    model_name: str
    block_size: int = 0  # 0: not reported


@dataclass(frozen=True)
class Ending:
    """Why the scheduler ended a rank's registration: `retry` when registering again may
    succeed (its group did not complete in time), else a refusal."""

    message: str
    retry: bool


@dataclass(eq=False)
class Member:
    """One accepted rank, for as long as its Register call lasts."""

    registration: Registration
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    ending: Ending | None = None

    def end(self, ending: Ending) -> None:
        self.ending = ending
        self.ended.set()


@dataclass(eq=False)
class _Group:
    world_size: int
    ranks: dict[int, Member] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None

    @property
    def complete(self) -> bool:
        return len(self.ranks) == self.world_size


class WorkerRegistry:
    def __init__(
        self,
        model_name: str,
        on_complete: Callable[[str, list[str], Callable[[str], None]], None],
        on_departure: Callable[[str], None],
        block_size: Callable[[], int] = lambda: 0,
        config: RegistryConfig | None = None,
    ) -> None:
        """`on_complete(name, addresses, refuse)`: a group has all its ranks; `refuse(reason)`
        ends its registration when it cannot serve."""
        self.model_name = model_name
        self.config = config or RegistryConfig()
        # The scheduler's block size: configured, or adopted from the first group (0: not yet).
        self._block_size = block_size
        self._on_complete = on_complete
        self._on_departure = on_departure
        self._groups: dict[str, _Group] = {}

    @property
    def num_pending(self) -> int:
        """Ranks registered in groups that are not complete yet."""
        return sum(len(g.ranks) for g in self._groups.values() if not g.complete)

    def join(self, r: Registration) -> Member | str:
        """Take a rank: its membership, or why it is refused (a rank that cannot serve here).
        Raises for what the registration policy refuses: FailedPrecondition (registration off),
        PermissionDenied (address not allowed), InvalidArgument (fields out of bounds),
        ResourceExhausted (too many ranks pending)."""
        self._check_policy(r)
        if r.model_name != self.model_name:
            return f"this scheduler serves model {self.model_name!r}, the worker serves {r.model_name!r}"
        expected = self._block_size()
        if expected and r.block_size and r.block_size != expected:
            return f"this scheduler uses KV blocks of {expected} tokens, the worker {r.block_size}; start it with --block-size {expected}"
        group = self._groups.get(r.group)
        if group is not None and group.world_size != r.world_size:
            return f"group {r.group!r} has {group.world_size} ranks, this rank says {r.world_size}"
        if group is not None and r.rank in group.ranks:
            taken = group.ranks[r.rank].registration.address
            return f"rank {r.rank} of group {r.group!r} is already registered (at {taken})"
        completes = (len(group.ranks) if group is not None else 0) + 1 == r.world_size
        if not completes and self.num_pending >= self.config.max_pending:
            raise ResourceExhausted(
                f"{self.num_pending} ranks already wait for the rest of their groups, the most this scheduler "
                "holds (RegistryConfig.max_pending); register again later"
            )
        joined = group if group is not None else self._groups.setdefault(r.group, _Group(r.world_size))
        member = Member(r)
        joined.ranks[r.rank] = member
        log.info("rank_registered", group=r.group, rank=r.rank, world_size=r.world_size, address=r.address)
        if joined.complete:
            self._stop_timer(joined)
            addresses = [joined.ranks[i].registration.address for i in range(r.world_size)]
            self._on_complete(r.group, addresses, lambda reason: self._refuse(r.group, joined, reason))
        elif joined.timer is None:
            self._start_timer(r.group, joined)
        return member

    def _check_policy(self, r: Registration) -> None:
        if not self.config.enabled:
            raise FailedPrecondition(
                "this scheduler takes no registrations (--no-registration): it serves its --worker addresses"
            )
        for name, value, most in (
            ("address", r.address, MAX_ADDRESS_LENGTH),
            ("group", r.group, MAX_NAME_LENGTH),
            ("model_name", r.model_name, MAX_NAME_LENGTH),
        ):
            if len(value) > most:
                raise InvalidArgument(name, f"{len(value)} characters, at most {most}")
        if not r.address:
            raise InvalidArgument("address", "the registration has no address to reach the worker at")
        if any(c == "," or c.isspace() or not c.isprintable() for c in r.address):
            # A comma separates a group's ranks where addresses are joined (fleet, --worker):
            # one rank's address must never smuggle in a second one to dial.
            raise InvalidArgument(
                "address", "one host:port or unix:///path, without commas, spaces or control characters"
            )
        if not 1 <= r.world_size <= MAX_WORLD_SIZE:
            raise InvalidArgument("world_size", f"{r.world_size}, want between 1 and {MAX_WORLD_SIZE}")
        if not 0 <= r.rank < r.world_size:
            raise InvalidArgument("rank", f"rank {r.rank} is not in a group of {r.world_size}")
        if r.block_size and r.block_size not in BLOCK_SIZES:
            raise InvalidArgument("block_size", f"{r.block_size}, want one of {', '.join(map(str, BLOCK_SIZES))}")
        if self.config.allow and not allowed(r.address, self.config.allow):
            raise PermissionDenied(
                f"address {r.address!r} is not on this scheduler's worker allow-list (--worker-allow)"
            )

    def leave(self, member: Member) -> None:
        """The rank's Register call ended (or the scheduler ended it)."""
        r = member.registration
        group = self._groups.get(r.group)
        if group is None or group.ranks.get(r.rank) is not member:
            return  # dropped already (timed out, refused)
        complete = group.complete
        del group.ranks[r.rank]
        log.info("rank_departed", group=r.group, rank=r.rank, address=r.address)
        if not group.ranks:
            self._stop_timer(group)
            del self._groups[r.group]
        elif complete:
            # The rest of a broken group waits again, as long as a new group would.
            self._start_timer(r.group, group)
        if complete:
            self._on_departure(r.group)

    def _start_timer(self, name: str, group: _Group) -> None:
        loop = asyncio.get_running_loop()
        group.timer = loop.call_later(self.config.join_timeout, self._expire, name, group)

    @staticmethod
    def _stop_timer(group: _Group) -> None:
        if group.timer is not None:
            group.timer.cancel()
            group.timer = None

    def _expire(self, name: str, group: _Group) -> None:
        group.timer = None
        if self._groups.get(name) is not group or group.complete:
            return
        missing = [r for r in range(group.world_size) if r not in group.ranks]
        message = (
            f"group {name!r} did not complete within {self.config.join_timeout:g}s "
            f"({len(group.ranks)} of {group.world_size} ranks registered; never joined: rank "
            f"{', '.join(map(str, missing))}): its ranks are dropped"
        )
        log.warning("group_expired", group=name, ranks=len(group.ranks), world_size=group.world_size, missing=missing)
        self._drop(name, group, Ending(message, retry=True))

    def _refuse(self, name: str, group: _Group, reason: str) -> None:
        """The engine will not serve with this group (its handshake): end its ranks' calls."""
        if self._groups.get(name) is group:
            self._drop(name, group, Ending(f"the scheduler refused group {name!r}: {reason}", retry=False))

    def _drop(self, name: str, group: _Group, ending: Ending) -> None:
        self._stop_timer(group)
        del self._groups[name]
        for member in group.ranks.values():
            member.end(ending)


def allowed(address: str, allow: tuple[str, ...]) -> bool:
    """Whether `address` matches an allow-list entry: the same host:port or unix:///path, or
    a bare host (any port of it)."""
    host, port = _split(address)
    for entry in allow:
        entry = entry.strip()
        if entry.startswith("unix:") or address.startswith("unix:"):
            if entry == address:
                return True
            continue
        entry_host, entry_port = _split(entry)
        if entry_host == host and entry_port in ("", port):
            return True
    return False


def _split(address: str) -> tuple[str, str]:
    """(host, port) of host:port, [v6]:port, a bare host or a bare v6 address; port "" if none."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host.lower(), rest[1:] if rest.startswith(":") else ""
    if address.count(":") == 1:
        host, _, port = address.partition(":")
        return host.lower(), port
    return address.lower(), ""
