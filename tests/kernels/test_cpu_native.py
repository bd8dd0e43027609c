"""Building, caching and loading the native CPU kernels, and the fallback without a compiler."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernels import cpu_native
from kernels.cpu_backend import CpuBackend


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Forget the process's loaded library for one test, restore it afterwards."""
    saved = dict(cpu_native._loaded)
    cpu_native._loaded.clear()
    yield
    cpu_native._loaded.clear()
    cpu_native._loaded.update(saved)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_loader")
def test_build_goes_to_the_cache_and_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if cpu_native._compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv(cpu_native.ENV_CACHE, str(tmp_path))
    assert cpu_native.load() is not None
    built = list(tmp_path.glob("ragserve_cpu_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_native._loaded.clear()
    assert cpu_native.load() is not None
    assert built[0].stat().st_mtime_ns == stamp, "a cached build was compiled again"
    assert list(tmp_path.glob("*.so")) == built, "a temporary file was left behind"


@pytest.mark.usefixtures("fresh_loader")
def test_without_a_compiler_the_backend_runs_pure_torch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setenv(cpu_native.ENV_CACHE, str(tmp_path))  # no cached build to fall back on
    monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_native"):
        assert cpu_native.load() is None
    assert "no C compiler" in caplog.text
    assert not CpuBackend().is_native


@pytest.mark.usefixtures("fresh_loader")
def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_native.ENV_DISABLE, "0")
    assert cpu_native.load() is None


def test_one_openmp_runtime_is_mapped() -> None:
    """The kernels share torch's libgomp: no second OpenMP thread pool."""
    if cpu_native.load() is None:
        pytest.skip("no native kernels")
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


def test_bf16_tiles_use_pair_products_where_the_cpu_has_them() -> None:
    """A build for a CPU with AVX-512 BF16 multiplies bf16 pairs (cpu_bf16_dot.h); others widen."""
    if cpu_native.load() is None:
        pytest.skip("no native kernels")
    flags = cpu_native._cpu_flags().split()
    assert cpu_native.bf16_dot() == ("avx512_bf16" in flags and "avx512f" in flags)


def test_bf16_tiles_multiply_on_amx_where_the_cpu_has_it() -> None:
    """A build for a CPU with AMX (and AVX-512 BF16) runs bf16 tiles on AMX tiles (cpu_amx.h)
    once Linux grants the tile state, as it does from 5.16 on; other CPUs never do."""
    if cpu_native.load() is None:
        pytest.skip("no native kernels")
    flags = set(cpu_native._cpu_flags().split())
    has_amx = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512f"} <= flags
    turned_off = os.environ.get(cpu_native.ENV_AMX) == "0"
    assert cpu_native.amx() == (has_amx and not turned_off)


def test_amx_can_be_turned_off(tmp_path: Path) -> None:
    """RAGSERVE_CPU_AMX=0 keeps bf16 tiles off AMX, whatever the CPU."""
    if cpu_native.load() is None:
        pytest.skip("no native kernels")
    env = dict(os.environ, RAGSERVE_CPU_AMX="0", RAGSERVE_KERNEL_CACHE=str(cpu_native.cache_dir()))
    code = "from kernels import cpu_native; print(cpu_native.amx())"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("pairs", ["0", "1"])
def test_every_bf16_tile_path_matches_the_reference(pairs: str) -> None:
    """bf16 prefill tiles run on AMX, on bf16 pair products or on float32 FMAs over widened
    K/V, as the CPU allows and a one-off timing picks; every bf16 test runs the one this
    process picked, and a process with AMX off and the choice forced checks the others."""
    if not cpu_native.bf16_dot():
        pytest.skip("without AVX-512 BF16, tiles always widen to float32")
    if not cpu_native.amx() and cpu_native.bf16_dot_tiles() == (pairs == "1"):
        pytest.skip("what every bf16 test in this process runs")
    env = {**os.environ, cpu_native.ENV_AMX: "0", cpu_native.ENV_BF16_DOT_TILES: pairs}
    code = "from kernels import cpu_native; print(cpu_native.bf16_dot_tiles())"
    forced = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert forced.stdout.strip() == str(pairs == "1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-o", "addopts="]
    command += [
        str(Path(__file__).with_name("test_cpu_backend.py")),
        "-k",
        "bfloat16 or random or long",
    ]
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
