"""`llmserve up`: the scheduler, its worker groups and the HTTP gateway on this machine, started
in order, restarted when one dies, and stopped in order on SIGINT or SIGTERM.

The offline `LLM` starts its workers the same way (llmserve/local_engine.py), with
`gpu_share` and the worker command line of worker.py.

Credentials: the workers and the scheduler share a token made here for this run
(LLMSERVE_WORKER_TOKEN in the workers' environment, never their argv). The gateway dials the
scheduler's gateway listener, an ephemeral port on loopback, where smg needs no key (it sends
none); with client keys, smg asks HTTP callers for them (llmserve/gateway.py: the first admin
key is smg's shared key, every other key serves /v1 only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
from dataclasses import replace

import structlog

from common.grpc.ports import check_free
from llmserve.cli import configs
from llmserve.cli.commands import run_until_signal
from llmserve.cli.worker import worker_args
from llmserve.gateway import Gateway, dial_address, smg_executable
from llmserve.supervisor import Supervised

log = structlog.get_logger("llmserve")


def cmd_up(a: argparse.Namespace) -> None:
    from scheduler_svc.api.server import SchedulerServer

    # The worker plane's token for this run: only our own workers and scheduler know it.
    token = secrets.token_urlsafe(32)
    server_config = configs.server_config(a, worker_token=token)
    model = configs.model_dir(a.model)
    configs.worker_config(a, model)  # validate worker flags before starting anything
    configs.check_tp(model, a.tp)
    configs.check_pp(model, a.pp, a.pp_layer_split)
    ranks = a.tp * a.pp
    if a.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {a.workers}")
    names = configs.served_names(a, model)
    gateway_config = configs.up_gateway_config(a, names)
    smg = None
    if gateway_config is not None:
        smg = smg_executable()
        configs.check_gateway_ports(gateway_config)
    # The scheduler's ports too, before a worker starts loading (PortUnavailable: exit 2).
    check_free(f"{a.host}:{a.port}", "--port")
    if a.metrics_port:
        check_free(f"{a.host}:{a.metrics_port}", "--metrics-port")
    sockdir = tempfile.mkdtemp(prefix="llmserve-")
    commands, addresses = [], []
    for i in range(a.workers):
        address = f"unix://{sockdir}/worker-{i}.sock"
        commands.append(
            [*worker_args(a, model), "--listen", address, "--parent-pid", str(os.getpid()), "--tp", str(a.tp)]
        )
        if ranks > 1:
            from llmserve.rank_launcher import rank_addresses

            address = ",".join(rank_addresses(address, ranks))
        addresses.append(address)
    # The TLS flags secure the public scheduler port only. The worker's socket lies in a
    # mkdtemp directory (mode 0700) that only this user's processes can enter, and nothing
    # but our own scheduler dials it, so TLS there would cost handshakes and guard nothing.

    async def body(stop: asyncio.Event) -> None:
        # Workers in sessions of their own: Ctrl-C in a terminal signals the whole foreground
        # process group, and a worker that stopped on it would be lost under a running step;
        # only `up` gets it, and drains like on SIGTERM.
        workers = [
            Supervised(cmd, env=_worker_env(gpu_share(i, ranks, a.workers), token), own_session=True)
            for i, cmd in enumerate(commands)
        ]
        server: SchedulerServer | None = None
        gateway: Gateway | None = None
        try:
            for worker in workers:
                worker.start()
            starting = SchedulerServer(
                model,
                addresses,
                server_config,
                configs.scheduler_config(a),
                gateway_address="127.0.0.1:0" if gateway_config is not None else None,
                served_name=names[0],
            )
            await starting.start()
            server = starting
            while not stop.is_set():
                for worker in workers:
                    worker.restart_if_dead()
                if gateway is not None:
                    gateway.restart_if_dead()
                    if not gateway.announced:
                        # The scheduler's `ready` line comes before smg answers on the HTTP
                        # port; `http_ready` marks that moment. In a thread: the probe may wait.
                        await asyncio.to_thread(gateway.announce_when_ready)
                elif gateway_config is not None and server.engine.ready:
                    # Once requests can be answered. Started earlier, smg would report itself
                    # ready at once (it counts a registered scheduler as healthy until health
                    # checks fail) and answer requests with the scheduler's UNAVAILABLE.
                    schedulers = (dial_address("127.0.0.1", server.gateway_port),)
                    gateway = Gateway(
                        replace(gateway_config, schedulers=schedulers, api_keys=configs.http_keys(server_config.auth)),
                        smg,
                    )
                    gateway.start()
                waiting_for_ready = gateway_config is not None and (gateway is None or not gateway.announced)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2 if waiting_for_ready else 1.0)
        finally:
            log.info("shutting_down")
            if gateway is not None:
                # First, and in a thread: smg drains its HTTP requests through the scheduler,
                # which this event loop keeps serving meanwhile.
                await asyncio.to_thread(gateway.stop)
            if server is not None:
                await server.stop()
            for worker in workers:
                worker.stop()
            shutil.rmtree(sockdir, ignore_errors=True)

    run_until_signal(body)


def _worker_env(env: dict[str, str] | None, token: str) -> dict[str, str]:
    return {**(env if env is not None else os.environ), configs.WORKER_TOKEN_ENV: token}


def gpu_share(index: int, tp: int, groups: int) -> dict[str, str] | None:
    """The environment of worker group `index`: its own `tp` of the visible GPUs.

    Worked out from CUDA_VISIBLE_DEVICES rather than by asking torch, which the scheduler's
    process never imports; with one group, or on a machine without GPUs, nothing changes.
    """
    if groups == 1:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(d) for d in range(groups * tp)]
    share = devices[index * tp : (index + 1) * tp]
    if len(share) < tp:
        raise ValueError(
            f"--workers {groups} x --tp {tp} needs {groups * tp} GPUs, CUDA_VISIBLE_DEVICES lists {len(devices)}"
        )
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(share)}
