"""The requests in flight: request id -> the RequestStream its caller reads, and the replica
(worker group) each is on now; it moves on recovery.

Engine admits and aborts, Fleet moves and fails, StepReporter finishes: all of them through
these verbs. A stream object, not an id, names a request: a caller may reuse an id once its
request ended, so a late abort, a stale step event or a lost group's leftovers must only ever
touch the stream that is still the current one for its id (`current`, `drop`).
"""

from __future__ import annotations

from collections.abc import Iterator

from common.errors import InvalidArgument
from scheduler_svc.engine.replica import Replica
from scheduler_svc.engine.request_stream import RequestStream
from scheduler_svc.sched.sequence_group import SequenceGroup


class LiveStreams:
    def __init__(self) -> None:
        self._by_id: dict[str, RequestStream] = {}
        self._placed: dict[str, Replica] = {}  # by request id, for the streams in _by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[RequestStream]:
        return iter(list(self._by_id.values()))

    def add(self, stream: RequestStream, replica: Replica) -> None:
        if stream.request_id in self._by_id:
            raise InvalidArgument("request_id", f"{stream.request_id!r} is already in flight")
        self._by_id[stream.request_id] = stream
        self._placed[stream.request_id] = replica

    def move(self, stream: RequestStream, replica: Replica) -> None:
        """`stream`'s request now runs on `replica` (recovery moved it there)."""
        if self.current(stream):
            self._placed[stream.request_id] = replica

    def replica_of(self, stream: RequestStream) -> Replica | None:
        """The replica the request is on now (None once it ended)."""
        return self._placed.get(stream.request_id) if self.current(stream) else None

    def get(self, request_id: str) -> RequestStream | None:
        return self._by_id.get(request_id)

    def of(self, group: SequenceGroup) -> RequestStream | None:
        """The stream of this very group (None for a group whose request has ended)."""
        stream = self._by_id.get(group.request_id)
        return stream if stream is not None and stream.group is group else None

    def current(self, stream: RequestStream) -> bool:
        return self._by_id.get(stream.request_id) is stream

    def drop(self, stream: RequestStream) -> bool:
        """Forget `stream` if it is still the current one for its id; True if it was."""
        if not self.current(stream):
            return False
        del self._by_id[stream.request_id]
        del self._placed[stream.request_id]
        return True

    def drop_group(self, group: SequenceGroup) -> RequestStream | None:
        """Forget and return the stream of this very group, if it is still in flight."""
        stream = self.of(group)
        if stream is not None:
            del self._by_id[group.request_id]
            del self._placed[group.request_id]
        return stream

    def clear(self) -> list[RequestStream]:
        """Forget every stream; returns them."""
        streams, self._by_id, self._placed = list(self._by_id.values()), {}, {}
        return streams
