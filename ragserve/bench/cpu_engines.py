"""The engine runs of ``ragserve bench cpu``: which variants, their environments, and one run
of ``cpu_driver.py`` in a fresh process, watched for start-up, peak RSS and progress."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ragserve

TCMALLOC_NAME = "libtcmalloc_minimal.so.4"
TCMALLOC_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
)
DRIVER = Path(__file__).with_name("cpu_driver.py")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    engine: str  # the driver's engine: ragserve or vllm
    command: list[str]
    env: dict[str, str]


def find_tcmalloc(choice: str) -> str | None:
    """``auto``: the library in the usual directories, or None; ``none``: None; else a path."""
    if choice == "none":
        return None
    if choice != "auto":
        if not Path(choice).is_file():
            raise ValueError(f"--tcmalloc {choice} does not exist")
        return choice
    found = (Path(d) / TCMALLOC_NAME for d in TCMALLOC_DIRS)
    return next((str(p) for p in found if p.is_file()), None)


def make_variants(
    vllm_python: str | None, tcmalloc: str | None, extra_env: dict[str, str]
) -> tuple[list[Variant], list[str]]:
    """ragserve as users get it, with tcmalloc where found, and vLLM where given; and notes
    on what was left out and why."""
    notes: list[str] = []
    root = str(Path(ragserve.__file__).resolve().parent.parent)
    ours = dict(os.environ, **extra_env)
    ours["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    ours.pop("LD_PRELOAD", None)
    command = [sys.executable, "-m", "ragserve.bench.cpu_driver", "ragserve"]
    variants = [Variant("ragserve", "ragserve", command, ours)]
    if tcmalloc:
        variants.append(
            Variant("ragserve+tcmalloc", "ragserve", command, dict(ours, LD_PRELOAD=tcmalloc))
        )
    else:
        notes.append("ragserve+tcmalloc skipped: no libtcmalloc_minimal (give --tcmalloc PATH)")
    if vllm_python is None:
        notes.append("vLLM skipped: no --vllm-python given")
    elif not Path(vllm_python).is_file():
        notes.append(f"vLLM skipped: {vllm_python} does not exist")
    else:
        # vLLM's recommended CPU set-up: tcmalloc preloaded, no core reserved away from compute.
        theirs = dict(os.environ, **extra_env, VLLM_CPU_NUM_OF_RESERVED_CPU="0")
        theirs.pop("PYTHONPATH", None)
        theirs.pop("LD_PRELOAD", None)
        if tcmalloc:
            theirs["LD_PRELOAD"] = tcmalloc
        else:
            notes.append("vLLM runs without tcmalloc (its recommended set-up preloads it)")
        variants.append(Variant("vllm", "vllm", [vllm_python, str(DRIVER), "vllm"], theirs))
    return variants, notes


def tree_rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (Linux /proc; 0 elsewhere)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = dict(
                line.split(":", 1)
                for line in (entry / "status").read_text().splitlines()
                if ":" in line
            )
        except OSError:
            continue  # exited meanwhile
        child = int(entry.name)
        parents[child] = int(fields["PPid"])
        rss[child] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    tree, frontier = {pid}, [pid]
    while frontier:
        current = frontier.pop()
        for child, parent in parents.items():
            if parent == current and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(rss.get(p, 0) for p in tree)


def run_variant(
    variant: Variant,
    spec_path: Path,
    log_path: Path,
    on_progress: Callable[[int], None],
    timeout_s: float = 3600.0,
    poll_s: float = 0.25,
) -> dict[str, Any]:
    """One engine run, alone: the driver's results plus start-up (spawn to ready, measured
    from here so that imports count), peak process-tree RSS and the exit code.

    ``on_progress(n)`` gets the number of steps done so far: 1 once ready, then one more per
    finished phase.
    """
    out_path = spec_path.with_name(f"{variant.name}-{time.monotonic_ns()}.out.json")
    results: dict[str, Any] = {}
    seen_mtime = 0.0
    peak = 0
    spawned = time.time()
    timed_out = False
    with open(log_path, "w") as log:
        # Its own process group, so that the engine's workers go with it on every exit.
        proc = subprocess.Popen(
            [*variant.command, str(spec_path), str(out_path)],
            env=variant.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            while proc.poll() is None:
                if time.time() - spawned > timeout_s:
                    timed_out = True
                    break
                peak = max(peak, tree_rss_bytes(proc.pid))
                if out_path.is_file() and out_path.stat().st_mtime != seen_mtime:
                    seen_mtime = out_path.stat().st_mtime
                    results = _read(out_path) or results
                    on_progress(1 + len(results.get("phases", {})))
                time.sleep(poll_s)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    results = _read(out_path) or results
    on_progress(1 + len(results.get("phases", {})))
    out_path.unlink(missing_ok=True)
    results["returncode"] = proc.returncode
    if timed_out:
        results["error"] = f"stopped after {timeout_s:.0f} s"
    results["peak_rss_bytes"] = peak
    if "ready_unix" in results:
        results["startup_s"] = results.pop("ready_unix") - spawned
    if proc.returncode != 0 or timed_out:
        results["log_tail"] = log_path.read_text()[-3000:]
    return results


def _read(path: Path) -> dict[str, Any] | None:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # replaced between the check and the read
    return loaded if isinstance(loaded, dict) else None
