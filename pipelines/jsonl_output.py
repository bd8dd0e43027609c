"""Append-only JSONL results that survive Ctrl-C and support resuming.

Invariant: the file is valid JSONL after every :meth:`JsonlWriter.write` returns, and after
any interruption. Each record is one ``write`` of a complete line followed by a flush,
with SIGINT held back until the line is out, so Ctrl-C never tears a line. A line torn by
something harder (a kill, a full disk) is cut off when the file is opened for resuming.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import IO, Any

logger = logging.getLogger(__name__)


class OutputExistsError(ValueError):
    """The output file has results and neither resuming nor overwriting was asked."""


class JsonlWriter:
    """Writes one JSON object per line to ``path``.

    ``resume=True`` keeps the records already there (their ``key`` values are in
    :attr:`done`); ``overwrite=True`` starts afresh; with neither, a non-empty existing
    file raises :class:`OutputExistsError` rather than losing results. The file is opened
    at the first record: a run that fails before it leaves an existing file as it was.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        resume: bool = False,
        overwrite: bool = False,
        key: str = "id",
    ) -> None:
        self.path = Path(path)
        self.key = key
        self.done: set[str] = set()
        self.num_written = 0
        if resume and overwrite:
            raise ValueError(
                "--resume keeps the results in the file, --overwrite drops them: pass one"
            )
        if self.path.is_dir():
            raise ValueError(f"{self.path} is a directory, not a results file")
        exists = self.path.exists() and self.path.stat().st_size > 0
        if exists and not resume and not overwrite:
            raise OutputExistsError(
                f"{self.path} already has results: pass --resume to continue it "
                "or --overwrite to start again"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._mode = "wb"
        if resume and exists:
            self.done = repair_and_read_keys(self.path, key)
            self._mode = "ab"
        self._file: IO[bytes] | None = None
        self._closed = False

    def write(self, record: Mapping[str, Any]) -> None:
        if self._closed:
            raise ValueError(f"{self.path} is closed")
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        if self._file is None:
            self._file = open(self.path, self._mode)  # noqa: SIM115 - closed by close()
        with sigint_deferred():
            self._file.write(line)
            self._file.flush()
        self.num_written += 1
        value = record.get(self.key)
        if value is not None:
            self.done.add(str(value))

    def close(self) -> None:
        self._closed = True
        if self._file is not None:
            with sigint_deferred():
                self._file.close()
            self._file = None

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def repair_and_read_keys(path: Path, key: str = "id") -> set[str]:
    """Values of ``key`` in the file's records, after cutting off a torn last line.

    Raises ValueError (with the line number) for a damaged line that is not the last one:
    appending after it would leave a file no reader accepts.
    """
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    torn = False
    if tail:
        try:
            json.loads(tail)
        except ValueError:
            torn = True
        else:
            lines.append(tail)
    # NOTE: every other line is checked before the file is touched: a file that is not
    # this command's results is refused whole, not cut first.
    keys: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(
                f"line {number} of {path} is not valid JSON ({exc}); fix or remove it"
            ) from None
        if isinstance(record, dict) and record.get(key) is not None:
            keys.add(str(record[key]))
    if torn and not tail.lstrip().startswith(b"{"):
        # NOTE: no cut-off record of ours: someone else's file (one line of notes, say),
        # refused rather than emptied.
        raise ValueError(
            f"the last line of {path} is neither JSON nor a cut-off result; fix or remove it"
        )
    if torn:
        logger.warning("%s: cutting off a torn last line (%d bytes)", path, len(tail))
        with open(path, "r+b") as file:
            file.truncate(len(data) - len(tail))
    elif tail:
        with open(path, "ab") as file:  # complete but unterminated: finish the line
            file.write(b"\n")
    return keys


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a JSONL file (strict: any bad line raises ValueError)."""
    records = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError as exc:
                    raise ValueError(f"line {number} of {path} is not valid JSON ({exc})") from None
    return records


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold SIGINT back for the duration; deliver it (to the previous handler) afterwards.

    Only the main thread can install signal handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[FrameType | None] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        received.append(frame)

    previous = signal.signal(signal.SIGINT, hold)
    if previous is None:  # installed outside Python: restore Python's default
        previous = signal.default_int_handler
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, received[0])
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt
