"""Reading pipeline inputs: one bad input is reported and skipped, ids stay stable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipelines.documents import DocumentIndex, ErrorHandler, load_documents
from pipelines.jsonl_output import JsonlWriter, read_records


def collect() -> tuple[list[tuple[str, str]], ErrorHandler]:
    failures: list[tuple[str, str]] = []
    return failures, lambda source, reason: failures.append((source, reason))


def test_a_lone_surrogate_skips_its_line_alone(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(
        '{"id": "ok1", "text": "fine"}\n'
        '{"id": "bad", "text": "half an emoji \\ud83d here"}\n'
        '{"id": "\\udc00", "text": "a bad id"}\n'
        '{"id": "ok2", "text": "fine too"}\n'
    )
    failures, on_error = collect()
    documents = load_documents(path, on_error)
    assert [d.id for d in documents] == ["ok1", "ok2"]
    reasons = dict(failures)
    assert set(reasons) == {f"{path}:2", f"{path}:3"}
    assert "surrogate" in reasons[f"{path}:2"] and "'id'" in reasons[f"{path}:3"]


def test_a_file_name_that_is_not_utf8_is_read_under_an_escaped_id(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in (b"a.txt", b"caf\xe9.txt", b"z.txt"):
        Path(os.fsdecode(bytes(folder) + b"/" + name)).write_text(f"text of {name!r}")
    failures, on_error = collect()
    documents = load_documents(folder, on_error)
    assert [d.id for d in documents] == ["a.txt", "caf\\xe9.txt", "z.txt"] and not failures
    out = tmp_path / "out.jsonl"
    with JsonlWriter(out) as writer:  # ids and sources can be written as results
        for document in documents:
            writer.write({"id": document.id, "source": document.source})
    assert [r["id"] for r in read_records(out)] == ["a.txt", "caf\\xe9.txt", "z.txt"]


def test_files_of_one_name_in_two_places_are_told_apart_by_path(tmp_path: Path) -> None:
    for folder in ("d1", "d2"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "x.txt").write_text(f"x of {folder}")
        (tmp_path / folder / "q.jsonl").write_text('{"text": "a line"}\n')
    (tmp_path / "d2" / "y.txt").write_text("only here")
    failures, on_error = collect()
    files = [str(tmp_path / "d1" / "x.txt"), str(tmp_path / "d2" / "x.txt")]
    ids = [d.id for d in load_documents(files, on_error)]
    assert ids == files  # each by its path, in either order
    assert [d.id for d in load_documents(files[::-1], on_error)] == files[::-1]
    folders = [str(tmp_path / "d1"), str(tmp_path / "d2")]
    documents = load_documents(folders, on_error)
    assert [(d.id, d.text) for d in documents] == [
        (f"{tmp_path}/d1/q.jsonl:1", "a line"),
        (f"{tmp_path}/d1/x.txt", "x of d1"),
        (f"{tmp_path}/d2/q.jsonl:1", "a line"),
        (f"{tmp_path}/d2/x.txt", "x of d2"),
        ("y.txt", "only here"),
    ]
    assert not failures
    with pytest.raises(KeyError, match="ambiguous"):
        DocumentIndex(documents).find("x.txt")
    explicit = tmp_path / "ids.jsonl"  # an id the user gave is the user's: a duplicate is one
    explicit.write_text('{"id": "y.txt", "text": "clash"}\n')
    assert [d.id for d in load_documents([folders[1], explicit], on_error)] == [
        "q.jsonl:1",
        "x.txt",
        "y.txt",
    ]
    assert "duplicate document id 'y.txt'" in failures[-1][1]


def test_a_left_out_file_inside_a_folder_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a document")
    (tmp_path / "questions.jsonl").write_text('{"doc": "a.txt", "question": "Why?"}\n')
    failures, on_error = collect()
    documents = load_documents(tmp_path, on_error, leave_out=[tmp_path / "questions.jsonl"])
    assert [d.id for d in documents] == ["a.txt"] and not failures
