"""A child process of `llmserve` (a local worker, the gateway): started, restarted if it dies,
stopped with us.

    python -m llmserve.supervisor PARENT_PID CMD [ARG...]

runs CMD in its own place (exec) after asking the kernel for SIGTERM when PARENT_PID dies: how
a program that cannot take `--parent-pid` itself (smg) still never outlives `llmserve`, even on
SIGKILL. `bound_to_this_process` builds that command line.
"""

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
    """Get SIGTERM when the parent dies, so no child outlives `llmserve up`, even on SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        sys.exit(0)


def bound_to_this_process(cmd: list[str]) -> list[str]:
    """`cmd` run through this module: it gets SIGTERM when the calling process dies."""
    return [sys.executable, "-m", "llmserve.supervisor", str(os.getpid()), *cmd]


class Supervised:
    """A child process, restarted if it dies: a local worker of `llmserve up` (the engine
    reconnects to it) or the gateway. Its log lines are named after it (`worker_started`,
    `gateway_exited`, ...).

    own_session: the child gets a session of its own, so that Ctrl-C in a terminal (SIGINT to
    the whole foreground process group) does not reach it and `stop` decides when it ends.
    """

    def __init__(
        self, cmd: list[str], env: dict[str, str] | None = None, *, name: str = "worker", own_session: bool = False
    ) -> None:
        self.cmd = cmd
        self.env = env  # None: this process's environment
        self.name = name
        self.own_session = own_session
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._restart_at: float | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=self.own_session)
        log.info(f"{self.name}_started", pid=self.proc.pid)

    def restart_if_dead(self) -> None:
        """Called every second by the event loop; never blocks it (backoff is a deadline)."""
        if self.proc is None or self.proc.poll() is None:
            return
        now = time.monotonic()
        if self._restart_at is None:
            self.restarts += 1
            self._restart_at = now + min(2.0**self.restarts, 30.0)
            log.error(f"{self.name}_exited", pid=self.proc.pid, returncode=self.proc.returncode, restarts=self.restarts)
        elif now >= self._restart_at:
            self._restart_at = None
            self.start()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds. Blocks: from an event loop that must
        keep serving meanwhile (the gateway drains through it), call it in a thread."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        log.info(f"{self.name}_stopped", pid=self.proc.pid, returncode=self.proc.returncode)


if __name__ == "__main__":
    # python -m llmserve.supervisor PARENT_PID CMD [ARG...]: see the module docstring.
    exit_with_parent(int(sys.argv[1]))
    os.execvp(sys.argv[2], sys.argv[2:])
