"""`llmserve worker --tp N`: the N rank processes of one tensor-parallel group, started
together and ended together.

Rank r listens at its own address, derived from --listen:

    127.0.0.1:50052        ->  rank 0 at :50052, rank 1 at :50053, ...
    unix:///run/w.sock     ->  rank 0 at /run/w.sock, rank 1 at /run/w.sock.1, ...

and the scheduler is given the list, in rank order (`--worker a,b,...`). The ranks meet at a
TCP rendezvous on this host. When any rank exits, the others are terminated and the group
exits non-zero: a group missing a rank can only hang in its next collective. Secrets (the
worker token) reach the ranks in their environment, never their command lines.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger("llmserve")


def rank_addresses(listen: str, world_size: int) -> list[str]:
    if listen.startswith("unix:"):
        return [listen if r == 0 else f"{listen}.{r}" for r in range(world_size)]
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--listen {listen!r}: want host:port or unix:///path")
    return [f"{host}:{int(port) + r}" for r in range(world_size)]


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankLauncher:
    def __init__(
        self,
        rank_cmd: list[str],
        listen: str,
        world_size: int,
        metrics_port: int = 0,
        advertise: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        """`rank_cmd`: the worker command line without --listen, the rank flags and metrics.

        With `metrics_port` P, rank r serves its metrics on P + r; with `advertise` (the address
        the scheduler dials for rank 0, when registering), rank r advertises its derived one.
        `env`: the ranks' whole environment (None: this process's).
        """
        self.env = env
        self.addresses = rank_addresses(listen, world_size)
        if metrics_port:
            taken = {int(a.rsplit(":", 1)[1]) for a in self.addresses if not a.startswith("unix:")}
            clash = taken & set(range(metrics_port, metrics_port + world_size))
            if clash:
                raise ValueError(
                    f"--metrics-port {metrics_port}: ranks would serve metrics on their gRPC ports {sorted(clash)}"
                )
        self.init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        advertised = rank_addresses(advertise, world_size) if advertise else []
        self.commands = [
            [
                *rank_cmd,
                "--listen",
                address,
                "--rank",
                str(r),
                "--world-size",
                str(world_size),
                "--dist-init",
                self.init_method,
                "--parent-pid",
                str(os.getpid()),
                *(["--metrics-port", str(metrics_port + r)] if metrics_port else []),
                *(["--advertise", advertised[r]] if advertise else []),
            ]
            for r, address in enumerate(self.addresses)
        ]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        self.procs = [subprocess.Popen(cmd, env=self.env) for cmd in self.commands]
        log.info(
            "rank_group_started",
            world_size=len(self.procs),
            addresses=",".join(self.addresses),
            pids=[p.pid for p in self.procs],
        )

    def wait(self, stop_requested: Callable[[], bool]) -> int:
        """Until a rank exits or a stop is requested; then end every rank. Returns the exit code."""
        while True:
            exited = [(r, p.returncode) for r, p in enumerate(self.procs) if p.poll() is not None]
            if exited or stop_requested():
                break
            time.sleep(0.2)
        # Ctrl-C reaches every rank too: ranks gone during a requested stop are not failures.
        failed = [] if stop_requested() else exited
        for rank, code in failed:
            log.error("rank_exited", rank=rank, returncode=code, action="ending the group")
        self.stop()
        return 1 if failed else 0

    def stop(self, timeout: float = 15.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
