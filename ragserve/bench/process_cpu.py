"""CPU time of the machine's processes, grouped by their role in a cluster run: what the
engines got and what Ray, the proxy, the ingress, the store and the client cost (Linux
``/proc``; empty elsewhere)."""

from __future__ import annotations

import os
from pathlib import Path

# NOTE: first match wins; Ray names its worker processes "ray::<actor or task>".
ROLES = (
    ("replicas", ":replica-"),
    ("ingress", ":ingress"),
    ("proxy", "ray::ProxyActor"),
    ("controller", "ray::ServeController"),
    ("store", "valkey-server"),
    ("store", "redis-server"),
    ("ray daemons", "/ray/"),
    ("ray daemons", "ray::"),
)


def _role(command: str, client_pid: int, pid: int) -> str:
    if pid == client_pid:
        return "client"
    for role, marker in ROLES:
        if marker in command:
            return role
    return "other"


Snapshot = dict[int, tuple[int, str, float]]


def cpu_seconds_by_process() -> Snapshot:
    """``pid -> (start time, command line, user + system CPU seconds)`` of every readable
    process. The start time tells a reused pid apart; the command line may change while a
    process lives (Ray retitles its workers with the task they run)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    found: Snapshot = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # NOTE: gone since the listing, or not ours to read
        fields = stat.rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        found[int(entry.name)] = (int(fields[19]), command, cpu)
    return found


def cores_by_role(before: Snapshot, after: Snapshot, seconds: float) -> dict[str, float]:
    """Average cores each role used between two ``cpu_seconds_by_process`` snapshots
    (a process that started in between counts from zero; one that ended is missed)."""
    used: dict[str, float] = {}
    client = os.getpid()
    for pid, (started, command, cpu) in after.items():
        previous = before.get(pid)
        start = previous[2] if previous is not None and previous[0] == started else 0.0
        role = _role(command, client, pid)
        used[role] = used.get(role, 0.0) + max(0.0, cpu - start)
    return {role: round(total / seconds, 3) for role, total in sorted(used.items())}
