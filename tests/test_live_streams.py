"""LiveStreams: a stream, not an id, names a request; stale ones never touch the current one."""

from __future__ import annotations

import itertools

import pytest

from common.errors import InvalidArgument
from scheduler_svc.engine.live_streams import LiveStreams
from scheduler_svc.engine.replica import Replica
from scheduler_svc.engine.request_stream import RequestStream
from tests.test_recovery import group


def _stream(request_id: str, ids: itertools.count[int]) -> RequestStream:
    g = group(ids, prompt_len=4, max_tokens=2, arrival=0)
    g.request_id = request_id
    return RequestStream(g, tokenizer=None, block_bytes=0)  # type: ignore[arg-type]


def _replica(name: str) -> Replica:
    return Replica(name, worker=None)  # type: ignore[arg-type]


def test_an_id_in_flight_is_refused() -> None:
    ids = itertools.count()
    live = LiveStreams()
    live.add(_stream("a", ids), _replica("r"))
    with pytest.raises(InvalidArgument, match="'a' is already in flight"):
        live.add(_stream("a", ids), _replica("r"))
    assert len(live) == 1


def test_a_stale_stream_never_drops_the_one_that_reuses_its_id() -> None:
    ids = itertools.count()
    live = LiveStreams()
    old, new = _stream("a", ids), _stream("a", ids)
    live.add(old, _replica("r"))
    assert live.drop(old) and not live.drop(old)
    live.add(new, _replica("r"))
    assert not live.drop(old) and not live.current(old) and live.current(new)
    assert live.of(old.group) is None and live.of(new.group) is new
    assert live.drop_group(old.group) is None and live.get("a") is new
    assert live.drop_group(new.group) is new and len(live) == 0


def test_clear_returns_every_stream() -> None:
    ids = itertools.count()
    live = LiveStreams()
    streams = [_stream(name, ids) for name in "abc"]
    for s in streams:
        live.add(s, _replica("r"))
    assert list(live) == streams
    assert live.clear() == streams and len(live) == 0 and live.get("a") is None


def test_the_replica_a_request_is_on_follows_its_moves_and_ends_with_it() -> None:
    ids = itertools.count()
    live = LiveStreams()
    first, second = _replica("r0"), _replica("r1")
    old = _stream("a", ids)
    live.add(old, first)
    assert live.replica_of(old) is first
    live.move(old, second)
    assert live.replica_of(old) is second
    assert live.drop(old) and live.replica_of(old) is None
    new = _stream("a", ids)
    live.add(new, first)
    live.move(old, second)  # a stale stream moves nothing
    assert live.replica_of(new) is first and live.replica_of(old) is None
    assert live.drop_group(new.group) is new and live.replica_of(new) is None
