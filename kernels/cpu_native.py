"""The native CPU kernels (``kernels/csrc/*.c``): compiled on first use, cached, bound by ctypes.

The C sources need only a C compiler with OpenMP (gcc or clang), not torch's headers, so a
build takes about a second and needs no pip build step. The shared library is compiled with
``-march=native`` for the CPU at hand and cached under ``$RAGSERVE_KERNEL_CACHE`` (default
``~/.cache/ragserve/kernels``), keyed by the sources, the flags, the compiler and the CPU's
feature flags, so a changed CPU or compiler builds anew. Without a compiler (or with
``RAGSERVE_CPU_NATIVE=0``) :func:`load` returns None once, logs why, and callers use their
pure-torch path.

NOTE: the library links ``libgomp.so.1`` by name. torch (imported first, always) has already
loaded its own ``libgomp.so.1``, and the dynamic loader reuses a loaded library of the same
soname, so the kernels share torch's OpenMP threads instead of starting a second pool that
would spin against it on a small machine.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # noqa: F401 (loads torch's libgomp before ours; see the NOTE above)

logger = logging.getLogger(__name__)

SOURCES = (
    "cpu_attention.c",
    "cpu_layer_ops.c",
    "cpu_small_linear.c",
    "cpu_amx_linear.c",
    "cpu_pairs_linear.c",
    "cpu_decoder_stack.c",
    "cpu_argmax.c",
)  # compiled into one library
HEADERS = ("cpu_kernels.h", "cpu_vec.h", "cpu_bf16_dot.h", "cpu_amx.h", "cpu_amx_attention.h")
CSRC = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC", "-Wall")
ENV_DISABLE = "RAGSERVE_CPU_NATIVE"
ENV_CACHE = "RAGSERVE_KERNEL_CACHE"

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | int | None] = {}  # "lib", its vector "width", build flags


class AttnParams(ctypes.Structure):
    """Mirror of ``AttnParams`` in ``csrc/cpu_attention.c``: one step's batch layout."""

    _fields_ = [
        ("num_seqs", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("is_bf16", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
        ("_pad", ctypes.c_int32),
        ("block_stride", ctypes.c_int64),
        ("kv_offset", ctypes.c_int64),
        ("table_stride", ctypes.c_int64),
        ("query_start", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("scale", ctypes.c_float),
    ]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE)
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "ragserve" / "kernels"


def _build(compiler: str, csrc: Path = CSRC) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout.splitlines()[:1]
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((csrc / name).read_bytes())
    digest.update(" ".join((*FLAGS, *version, _cpu_flags(), platform.machine())).encode())
    target = cache_dir() / f"ragserve_cpu_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: build under a temporary name and rename: processes starting together each build
    # and the last rename wins, and no process ever loads a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = [compiler, *FLAGS, "-o", tmp, *(str(csrc / name) for name in SOURCES), "-lm"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr.strip()[-2000:]}")
    os.replace(tmp, target)
    logger.info("built the native CPU kernels: %s", target)
    return target


def _bind(library: ctypes.CDLL) -> ctypes.CDLL:
    pointer, int64 = ctypes.c_void_p, ctypes.c_int64
    library.ragserve_paged_attention.argtypes = [
        ctypes.POINTER(AttnParams),
        pointer,
        int64,
        pointer,
        int64,
        pointer,
        int64,
        pointer,
        pointer,
        pointer,
    ]
    library.ragserve_paged_attention.restype = ctypes.c_int
    int32, flt = ctypes.c_int, ctypes.c_float
    library.ragserve_add_rms_norm.argtypes = [
        int32,
        int64,
        int64,
        pointer,
        pointer,
        pointer,
        flt,
        pointer,
        int32,
    ]
    library.ragserve_add_rms_norm.restype = ctypes.c_int
    library.ragserve_silu_mul.argtypes = [int32, int64, int64, pointer, int64, pointer, int32]
    library.ragserve_silu_mul.restype = ctypes.c_int
    library.ragserve_rotary.argtypes = [
        int32,
        int64,
        int32,
        int32,
        pointer,
        int64,
        pointer,
        pointer,
        pointer,
        int64,
        int32,
    ]
    library.ragserve_rotary.restype = None
    library.ragserve_small_linear.argtypes = [
        int64,
        int64,
        int64,
        pointer,
        pointer,
        pointer,
        pointer,
        int32,
    ]
    library.ragserve_small_linear.restype = ctypes.c_int
    library.ragserve_small_linear_bf16.argtypes = library.ragserve_small_linear.argtypes
    library.ragserve_small_linear_bf16.restype = ctypes.c_int
    library.ragserve_amx_linear_bf16.argtypes = library.ragserve_small_linear.argtypes
    library.ragserve_amx_linear_bf16.restype = ctypes.c_int
    library.ragserve_pairs_linear_bf16.argtypes = library.ragserve_small_linear.argtypes
    library.ragserve_pairs_linear_bf16.restype = ctypes.c_int
    library.ragserve_pairs_silu_mul_bf16.argtypes = library.ragserve_small_linear.argtypes
    library.ragserve_pairs_silu_mul_bf16.restype = ctypes.c_int
    library.ragserve_decoder_stack.argtypes = [pointer]
    library.ragserve_argmax_rows.argtypes = [int32, int64, int64, pointer, int64, pointer, int32]
    library.ragserve_argmax_rows.restype = ctypes.c_int
    library.ragserve_decoder_stack.restype = ctypes.c_int
    library.ragserve_vector_width.restype = ctypes.c_int
    library.ragserve_bf16_dot.restype = ctypes.c_int
    library.ragserve_bf16_dot_tiles.restype = ctypes.c_int
    library.ragserve_amx.restype = ctypes.c_int
    return library


def load() -> ctypes.CDLL | None:
    """The native kernels, built if needed; None (logged once) where they cannot be."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]  # type: ignore[return-value]
        library = None
        if os.environ.get(ENV_DISABLE, "1") == "0":
            logger.info("native CPU kernels disabled (%s=0): pure-torch CPU attention", ENV_DISABLE)
        elif platform.system() != "Linux":
            logger.warning("native CPU kernels are built on Linux only: pure-torch CPU attention")
        else:
            compiler = _compiler()
            if compiler is None:
                logger.warning(
                    "no C compiler (gcc, cc, clang; or $CC) found: pure-torch CPU attention"
                )
            else:
                try:
                    library = _bind(ctypes.CDLL(str(_build(compiler))))
                except (OSError, RuntimeError) as exc:
                    logger.warning(
                        "native CPU kernels unavailable, pure-torch CPU attention: %s", exc
                    )
        _loaded["lib"] = library
        return library


def build_from(csrc: Path) -> ctypes.CDLL:
    """The library built from the sources in ``csrc`` (another revision's, for comparing
    builds), bound as :func:`load`'s. Raises RuntimeError where it cannot be built, or where
    its entry points are not the ones this module binds."""
    missing = [name for name in (*SOURCES, *HEADERS) if not (csrc / name).is_file()]
    if missing:
        raise RuntimeError(f"{csrc} has no {', '.join(missing)}")
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (gcc, cc, clang; or $CC) found")
    try:
        return _bind(ctypes.CDLL(str(_build(compiler, csrc))))
    except AttributeError as exc:
        raise RuntimeError(f"the kernels in {csrc} lack an entry point: {exc}") from None


def install(library: ctypes.CDLL) -> None:
    """Make ``library`` the one :func:`load` returns from now on (every caller looks it up per
    call). For comparing builds in one process; the build-time flags that :func:`load`'s
    first call read (vector width, AVX-512 BF16, AMX) must be the same for both."""
    with _lock:
        _loaded["lib"] = library


def vector_width() -> int | None:
    """Floats per vector the kernels were built for (8: AVX2, 16: AVX-512), or None."""
    width = _loaded.get("width")
    if width is None and "width" not in _loaded:
        library = load()
        width = None if library is None else int(library.ragserve_vector_width())
        _loaded["width"] = width
    return width  # type: ignore[return-value]


def _build_flag(name: str) -> bool:
    """The library's ``ragserve_<name>()`` as a bool (False without the library), asked once:
    every bf16 linear call of a few rows checks these."""
    flag = _loaded.get(name)
    if flag is None:
        library = load()
        flag = _loaded[name] = library is not None and bool(getattr(library, f"ragserve_{name}")())
    return bool(flag)


def bf16_dot() -> bool:
    """Whether the build multiplies bf16 pairs (AVX-512 BF16): bf16 decodes' attention and
    products of one or two rows."""
    return _build_flag("bf16_dot")


ENV_BF16_DOT_TILES = "RAGSERVE_CPU_BF16_DOT_TILES"


def bf16_dot_tiles() -> bool:
    """Whether bf16 prefill tiles (without AMX) multiply bf16 pairs rather than float32 FMAs
    over widened K/V: ``RAGSERVE_CPU_BF16_DOT_TILES=1`` or ``0``, else whichever a
    one-off timing on this CPU finds faster (``csrc/cpu_attention.c``)."""
    return _build_flag("bf16_dot_tiles")


ENV_AMX = "RAGSERVE_CPU_AMX"


def amx() -> bool:
    """Whether bf16 attention and linears of a few rows multiply on AMX tiles: an AMX build
    that the OS lets use them, unless ``RAGSERVE_CPU_AMX=0`` (read once, at the first ask)."""
    return _build_flag("amx")
