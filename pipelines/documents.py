"""Reading pipeline inputs: .txt/.md files, .jsonl files with a ``text`` field, and folders.

A bad input (missing, unreadable, binary, not UTF-8, empty, a bad JSONL line, a duplicate
id) never stops a run: it is handed to ``on_error(source, reason)`` and skipped.

Document ids are stable across runs (resume depends on it): a file named on the command
line is its file name; a file found in a folder is its path relative to that folder; a
JSONL line is its ``id`` field, else ``<file id>:<line number>``. Files that would share an
id (two folders' ``README.md``) are each named by their path as given instead.
Bytes of a file name that are not UTF-8 appear as ``\\xNN``.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = frozenset({".txt", ".md"})
JSONL_SUFFIXES = frozenset({".jsonl"})
ErrorHandler = Callable[[str, str], None]


@dataclass(frozen=True)
class Document:
    """One input text of a batch pipeline, named by an id that is stable across runs."""

    id: str
    text: str
    source: str = ""  # the file (and line) it came from; "" when given in memory


Input = str | os.PathLike[str] | Document | Mapping[str, Any]


def log_error(source: str, reason: str) -> None:
    """The default ``on_error``: a warning in the log."""
    logger.warning("skipped %s: %s", source, reason)


def load_documents(
    inputs: Input | Iterable[Input],
    on_error: ErrorHandler = log_error,
    leave_out: Iterable[str | os.PathLike[str]] = (),
) -> list[Document]:
    """Documents from paths (files or folders, walked recursively), ``Document``s or dicts.

    One path, document or dict may be passed alone. A dict needs a non-empty ``text`` and
    may carry an ``id`` (default: its position). Files in ``leave_out`` (a questions file
    inside a documents folder) are not read from folders.
    """
    if isinstance(inputs, (str, os.PathLike, Document, Mapping)):
        inputs = [inputs]  # one input, not an iterable of characters or keys
    skipped = {Path(p).resolve() for p in leave_out}
    found: list[tuple[Document, str | None]] = []
    for position, item in enumerate(inputs):
        if isinstance(item, Document):
            if not item.text.strip():
                on_error(item.source or item.id, "empty document")
                continue
            found.append((item, None))
        elif isinstance(item, Mapping):
            mapped = _from_mapping(item, f"<input {position}>", str(position), on_error)
            found += ((document, None) for document in mapped)
        else:
            found += _from_path(Path(item), on_error, skipped)
    # NOTE: files of one name in several places are all named by their paths, whatever
    # the order of the inputs (resume depends on it).
    names = Counter(document.id for document, path_id in found if path_id is not None)
    documents: list[Document] = []
    seen: dict[str, str] = {}
    for document, path_id in found:
        if path_id is not None and names[document.id] > 1:
            document = Document(path_id, document.text, document.source)
        if document.id in seen:
            on_error(
                document.source or document.id,
                f"duplicate document id {document.id!r} (first from {seen[document.id]})",
            )
            continue
        if not is_utf8(document.text):
            on_error(document.source or document.id, "text holds a lone UTF-16 surrogate")
            continue
        seen[document.id] = document.source or document.id
        documents.append(document)
    return documents


def is_utf8(text: str) -> bool:
    """False for a lone surrogate (JSON's ``"\\ud83d"``): no UTF-8 encodes it."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _name(path: Path | str) -> str:
    """A file name as text: undecodable bytes (kept by Python as surrogates) as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _from_path(
    path: Path, on_error: ErrorHandler, leave_out: set[Path]
) -> Iterator[tuple[Document, str | None]]:
    """Documents of a file or folder, each with its id by the path as given (or None)."""
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix.lower() in TEXT_SUFFIXES | JSONL_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
            and (p.is_file() or p.is_symlink())
            and p.resolve() not in leave_out
        )
        for file in files:
            yield from _from_file(file, _name(file.relative_to(path).as_posix()), on_error)
    elif path.exists() or path.is_symlink():
        yield from _from_file(path, _name(path.name), on_error)
    else:
        on_error(_name(path), "no such file or folder")


def _from_file(
    path: Path, file_id: str, on_error: ErrorHandler
) -> Iterator[tuple[Document, str | None]]:
    text = read_text_file(path, on_error)
    if text is None:
        return
    path_id = _name(path.as_posix())
    if path.suffix.lower() in JSONL_SUFFIXES:
        yield from _from_jsonl(text, path, file_id, path_id, on_error)
    else:
        yield Document(file_id, text, path_id), path_id


def read_text_file(path: Path, on_error: ErrorHandler) -> str | None:
    """The file's text, or None after reporting why it cannot be used."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        on_error(_name(path), f"unreadable: {exc.strerror or exc}")
        return None
    if b"\x00" in data[:65536]:
        on_error(_name(path), "binary file (contains NUL bytes)")
        return None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        on_error(_name(path), f"not UTF-8 text (invalid byte at offset {exc.start})")
        return None
    if not text.strip():
        on_error(_name(path), "empty file")
        return None
    return text


def _from_jsonl(
    text: str, path: Path, file_id: str, path_id: str, on_error: ErrorHandler
) -> Iterator[tuple[Document, str | None]]:
    """Each line's document, with its id by path when the line gives no id of its own."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        source = f"{_name(path)}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            on_error(source, f"invalid JSON: {exc.msg} at column {exc.colno}")
            continue
        if not isinstance(record, dict):
            on_error(source, f"a line must be a JSON object, got {type(record).__name__}")
            continue
        by_path = None if "id" in record else f"{path_id}:{number}"
        for document in _from_mapping(record, source, f"{file_id}:{number}", on_error):
            yield document, by_path


def _from_mapping(
    record: Mapping[str, Any], source: str, default_id: str, on_error: ErrorHandler
) -> Iterator[Document]:
    text = record.get("text")
    if not isinstance(text, str) or not text.strip():
        on_error(source, "needs a non-empty string field 'text'")
        return
    raw_id = record.get("id", default_id)
    if (
        not isinstance(raw_id, (str, int))
        or isinstance(raw_id, bool)
        or str(raw_id) == ""
        or not is_utf8(str(raw_id))
    ):
        on_error(source, f"'id' must be a non-empty string or an integer, got {raw_id!r}")
        return
    yield Document(str(raw_id), text, source)


class DocumentIndex:
    """Finds a document by id, by file name or by source path (in that order).

    Raises ``KeyError`` with a message naming the candidates when the name is unknown or
    matches several documents.
    """

    def __init__(self, documents: Iterable[Document]) -> None:
        self.by_id: dict[str, Document] = {}
        self._by_name: dict[str, list[Document]] = {}
        self._by_source: dict[str, Document] = {}
        for document in documents:
            self.by_id[document.id] = document
            if document.source:
                self._by_source[document.source] = document
                self._by_name.setdefault(Path(document.source).name, []).append(document)

    def find(self, name: str) -> Document:
        if name in self.by_id:
            return self.by_id[name]
        matches = self._by_name.get(name, [])
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            ids = ", ".join(d.id for d in matches[:5])
            raise KeyError(f"document {name!r} is ambiguous: use one of the ids {ids}")
        if name in self._by_source:
            return self._by_source[name]
        raise KeyError(f"unknown document {name!r} ({len(self.by_id)} documents loaded)")
