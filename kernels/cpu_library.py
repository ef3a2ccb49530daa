"""The CPU kernels' shared library: built from `kernels/cpu/*.cpp` on first use, then cached.

The sources are plain C++ with OpenMP, no torch headers, so a build takes a few seconds with
the system's g++. It is compiled for the machine it runs on (`-march=native`: AVX-512 and
bf16 conversions where the CPU has them) and cached under
`$LLMSERVE_CACHE/kernels/<hash>/` (default `~/.cache/llmserve`), keyed by the sources, the
compiler, the flags and the CPU's feature flags; a build is written to a temporary name and
renamed, so ranks starting together never load a half-written file. The library links the
same OpenMP runtime torch loaded (`libgomp.so.1`), so its threads are torch's threads.

The "portable" variant compiles the same sources without AVX-512 intrinsics (lane loops the
compiler vectorizes as it can): what a CPU without AVX-512 runs; tests check it too.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from ctypes import c_float, c_int, c_int64, c_void_p
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
VARIANTS = ("native", "portable")
# -ffp-contract=off: a * b + c rounds twice, as torch computes it (explicit FMAs are vfma).
_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-Wall", "-Wno-maybe-uninitialized"]
_VARIANT_FLAGS = {"native": ["-march=native"], "portable": ["-march=native", "-DLLMSERVE_PORTABLE"]}

_P = c_void_p
# C signatures of every entry point; each exists for f32 and bf16 (suffix).
SIGNATURES: dict[str, list[type]] = {
    "paged_attention": [
        _P,
        c_int64,
        _P,
        _P,
        _P,  # block_ids
        _P,  # block_offsets
        _P,
        _P,
        _P,
        c_int,
        c_int,
        c_int,
        c_int,
        c_int,
        c_float,
        c_int,  # window
        c_float,  # softcap
        _P,
        c_int64,
        c_int,
    ],
    "rms_norm": [_P, c_int64, _P, c_int64, _P, c_float, _P, c_int64, c_int64, c_int, c_int],
    "rotary": [_P, c_int64, c_int, _P, c_int64, c_int, c_int, _P, _P, _P, c_int64, c_int],
    "store_kv": [_P, c_int64, _P, c_int64, _P, _P, _P, c_int64, c_int64, c_int],
    "silu_and_mul": [_P, c_int64, _P, c_int64, c_int64, c_int, c_int],
    "logits_stats": [_P, c_int64, c_int64, c_int64, _P, _P, c_int],
}
SUFFIXES = ("f32", "bf16")
# Entry points that return a status (0 = done); the others return nothing.
RETURNS: dict[str, type] = {"paged_attention": c_int}
# Entry points of one dtype only (bfloat16 GEMMs, linear.cpp): full name -> (argtypes, restype).
SINGLE: dict[str, tuple[list[type], type | None]] = {
    "packed_linear_elems": ([c_int, c_int], c_int64),
    "pack_linear_bf16": ([_P, c_int64, c_int, c_int, c_int, _P], c_int),
    "linear_bf16": ([_P, c_int64, c_int, c_int, _P, c_int, _P, _P, c_int64, c_int, c_int, c_int], c_int),
}


class CpuKernelsUnavailable(RuntimeError):
    """No C++ compiler, or the build failed: the worker falls back to the torch kernels."""


def cache_dir() -> Path:
    """$LLMSERVE_CACHE/kernels (default ~/.cache/llmserve/kernels), where builds are kept."""
    return Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve")) / "kernels"


def compiler() -> str:
    """$CXX, else g++, else c++; raises CpuKernelsUnavailable when there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    raise CpuKernelsUnavailable("no C++ compiler found (set CXX, or install g++)")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it does not say)."""
    return frozenset(_cpu_signature().partition(":")[2].split())


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_key(cxx: str, variant: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    for part in (version, " ".join(_FLAGS + _VARIANT_FLAGS[variant]), platform.machine(), _cpu_signature()):
        digest.update(part.encode())
    for source in sorted(SOURCE_DIR.iterdir()):
        if source.suffix in (".cpp", ".h"):
            digest.update(source.name.encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def build(variant: str = "native") -> Path:
    """Path of the variant's library, compiling it first if no cached build matches.

    Each source compiles in its own process (as many at once as there are cores), then one
    link; a first build takes a few seconds."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    cxx = compiler()
    target = cache_dir() / _build_key(cxx, variant) / f"libllmserve_cpu_{variant}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    flags = [*_FLAGS, *_VARIANT_FLAGS[variant]]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects, failures = [], []
        pending = sorted(SOURCE_DIR.glob("*.cpp"), key=lambda p: -p.stat().st_size)  # longest first
        running: list[tuple[subprocess.Popen[str], list[str]]] = []
        while pending or running:
            while pending and len(running) < max(os.cpu_count() or 1, 1):
                source = pending.pop(0)
                obj = str(Path(tmp) / f"{source.stem}.o")
                cmd = [cxx, *flags, "-c", str(source), "-o", obj]
                objects.append(obj)
                running.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), cmd))
            proc, cmd = running.pop(0)
            _, err = proc.communicate()
            if proc.returncode != 0:
                failures.append(f"{' '.join(cmd)}:\n{err[-4000:]}")
        if failures:
            raise CpuKernelsUnavailable("building the CPU kernels failed: " + "\n".join(failures))
        library = str(Path(tmp) / target.name)
        cmd = [cxx, *flags, "-o", library, *objects]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise CpuKernelsUnavailable(f"linking the CPU kernels failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        os.replace(library, target)
    return target


_loaded: dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()


def load(variant: str = "native") -> ctypes.CDLL:
    """The variant's library with typed entry points (built on first use, once per process)."""
    with _lock:
        lib = _loaded.get(variant)
        if lib is None:
            # torch first: its libgomp.so.1 is then the one the library binds to.
            import torch  # noqa: F401

            lib = ctypes.CDLL(str(build(variant)))
            for name, argtypes in SIGNATURES.items():
                for suffix in SUFFIXES:
                    fn = getattr(lib, f"llmserve_{name}_{suffix}")
                    fn.argtypes = argtypes
                    fn.restype = RETURNS.get(name)
            for name, (argtypes, restype) in SINGLE.items():
                fn = getattr(lib, f"llmserve_{name}")
                fn.argtypes = argtypes
                fn.restype = restype
            _loaded[variant] = lib
        return lib
