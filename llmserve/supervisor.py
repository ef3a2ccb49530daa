"""A local worker process of `llmserve up`: started, restarted if it dies, stopped with us."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

import structlog

log = structlog.get_logger("llmserve")


def exit_with_parent(parent_pid: int) -> None:
    """Get SIGTERM when the parent dies, so no worker outlives `llmserve up`, even on SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(0)


class Supervised:
    """The local worker process of `llmserve up`, restarted if it dies (the engine reconnects)."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.env = env  # None: this process's environment
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._restart_at: float | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env)
        log.info("worker_started", pid=self.proc.pid)

    def restart_if_dead(self) -> None:
        """Called every second by the event loop; never blocks it (backoff is a deadline)."""
        if self.proc is None or self.proc.poll() is None:
            return
        now = time.monotonic()
        if self._restart_at is None:
            self.restarts += 1
            self._restart_at = now + min(2.0**self.restarts, 30.0)
            log.error("worker_exited", pid=self.proc.pid, returncode=self.proc.returncode, restarts=self.restarts)
        elif now >= self._restart_at:
            self._restart_at = None
            self.start()

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        log.info("worker_stopped", pid=self.proc.pid, returncode=self.proc.returncode)
