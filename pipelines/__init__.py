"""Batch pipelines on the engine: map-reduce summarization and document QA."""

from pipelines.docqa import Question, docqa, load_questions
from pipelines.documents import Document, load_documents
from pipelines.summarize import summarize

__all__ = ["Document", "Question", "docqa", "load_documents", "load_questions", "summarize"]
