"""`llmserve worker --tp N`: rank addresses, rank command lines, and the rank device."""

from __future__ import annotations

import pytest
import torch

from llmserve.rank_launcher import RankLauncher, rank_addresses
from worker_svc.service.server import rank_device


def test_rank_addresses_follow_the_listen_address() -> None:
    assert rank_addresses("127.0.0.1:50052", 3) == ["127.0.0.1:50052", "127.0.0.1:50053", "127.0.0.1:50054"]
    assert rank_addresses("unix:///run/w.sock", 2) == ["unix:///run/w.sock", "unix:///run/w.sock.1"]
    with pytest.raises(ValueError, match="host:port"):
        rank_addresses("nowhere", 2)


def test_each_rank_gets_its_flags_and_its_own_metrics_port() -> None:
    group = RankLauncher(["llmserve", "worker"], "127.0.0.1:50052", 2, metrics_port=9100)
    for rank, cmd in enumerate(group.commands):
        flags = dict(zip(cmd[2::2], cmd[3::2]))
        assert flags["--rank"] == str(rank) and flags["--world-size"] == "2"
        assert flags["--listen"] == f"127.0.0.1:{50052 + rank}" and flags["--metrics-port"] == str(9100 + rank)
        assert flags["--dist-init"] == group.init_method
    with pytest.raises(ValueError, match="gRPC ports"):
        RankLauncher(["llmserve", "worker"], "127.0.0.1:50052", 2, metrics_port=50053)


def test_rank_device_offsets_from_the_named_gpu() -> None:
    cpu = torch.device("cpu")
    assert rank_device(cpu, 1, 2) == cpu
    if torch.cuda.device_count() >= 2:
        assert [rank_device(torch.device("cuda:0"), r, 2) for r in range(2)] == [
            torch.device("cuda", 0),
            torch.device("cuda", 1),
        ]
    # A group wider than the visible GPUs is refused at start, naming the count.
    with pytest.raises(ValueError, match=f"{torch.cuda.device_count()} GPUs are visible"):
        rank_device(torch.device("cuda:0"), torch.cuda.device_count(), torch.cuda.device_count() + 2)
