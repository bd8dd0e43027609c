"""Synthetic long documents, questions and chat prompts for the load tests: deterministic.

The same ``(seed, key)`` always gives the same text, so every locust user (and every run)
uploads byte-identical documents and the server's content-hashed document ids and KV
blocks are shared between them, as with a real shared corpus. Documents are maintenance
manuals made of numbered facts; questions ask about facts that are in the text.

Popularity is Zipf-like: document ``i`` (0-based) is picked with weight ``1 / (i + 1)^s``,
so a few documents are hot and the tail is cold.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass

# NOTE: measured on SmolLM2's tokenizer for this generator's text (≈1.6 tokens a word);
# sizes are approximate by design, the server reports the exact count on upload.
TOKENS_PER_WORD = 1.6
MIN_DOCUMENT_TOKENS = 32

_SYSTEMS = (
    "pump",
    "valve",
    "compressor",
    "turbine",
    "boiler",
    "heat exchanger",
    "chiller",
    "conveyor",
    "generator",
    "filter bank",
    "cooling tower",
    "gearbox",
)
_PARTS = (
    "bearing",
    "seal",
    "impeller",
    "shaft",
    "housing",
    "gasket",
    "rotor",
    "coupling",
    "sensor",
    "actuator",
    "manifold",
    "nozzle",
)
_QUANTITIES = (
    ("pressure", "bar"),
    ("temperature", "degrees Celsius"),
    ("speed", "rpm"),
    ("flow rate", "litres per minute"),
    ("torque", "newton metres"),
    ("voltage", "volts"),
)
_PERIODS = ("days", "weeks", "months")
_SITES = ("Oslo", "Porto", "Quito", "Lagos", "Hanoi", "Perth", "Tromso", "Cusco")

CHAT_TOPICS = (
    "How do I plan a three-day trip to a city I have never visited?",
    "What are good habits for writing readable Python code?",
    "Explain how a refrigerator keeps food cold.",
    "Give me a simple weekly plan to start running.",
    "Why is the sky blue?",
    "How should I prepare for a job interview?",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a vegetarian dinner I can cook in thirty minutes.",
)
FOLLOW_UPS = (
    "Can you say more about that?",
    "What would you do first?",
    "Summarize that in one sentence.",
    "Give me one concrete example.",
    "What is a common mistake here?",
    "And how long would that take?",
)
SUMMARY_REQUEST = "Summarize the document above in a few sentences."


@dataclass(frozen=True)
class CorpusDocument:
    """One document: ``key`` is stable across runs; ``questions`` are answerable from ``text``."""

    key: str
    text: str
    questions: tuple[str, ...]


@dataclass(frozen=True)
class Corpus:
    """Documents in popularity order (index 0 is the hottest) with their Zipf weights."""

    documents: tuple[CorpusDocument, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.documents or len(self.documents) != len(self.weights):
            raise ValueError(
                f"a corpus needs documents and one weight each, got {len(self.documents)} "
                f"documents and {len(self.weights)} weights"
            )

    def pick(self, rng: random.Random) -> CorpusDocument:
        """A document drawn by popularity."""
        cumulative = list(itertools.accumulate(self.weights))
        index = bisect.bisect_right(cumulative, rng.random() * cumulative[-1])
        return self.documents[min(index, len(self.documents) - 1)]


def zipf_weights(count: int, exponent: float) -> tuple[float, ...]:
    """Normalised weights ``1 / (rank)^exponent`` for ranks 1..count."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if exponent < 0:
        raise ValueError(f"the Zipf exponent must be >= 0, got {exponent}")
    raw = [1.0 / (rank**exponent) for rank in range(1, count + 1)]
    total = sum(raw)
    return tuple(w / total for w in raw)


def build_corpus(
    num_documents: int, approx_tokens: int, seed: int = 0, zipf_exponent: float = 1.1
) -> Corpus:
    """``num_documents`` manuals of about ``approx_tokens`` tokens each."""
    if num_documents < 1:
        raise ValueError(f"num_documents must be >= 1, got {num_documents}")
    documents = tuple(
        make_document(f"doc-{index:03d}", approx_tokens, seed) for index in range(num_documents)
    )
    return Corpus(documents, zipf_weights(num_documents, zipf_exponent))


def make_document(
    key: str, approx_tokens: int, seed: int = 0, num_questions: int = 8
) -> CorpusDocument:
    """A manual of about ``approx_tokens`` tokens, determined by ``(seed, key)`` alone."""
    if approx_tokens < MIN_DOCUMENT_TOKENS:
        raise ValueError(
            f"documents need at least {MIN_DOCUMENT_TOKENS} tokens, got {approx_tokens}"
        )
    rng = random.Random(f"{seed}:{key}")
    site = rng.choice(_SITES)
    lines = [f"Maintenance manual {key} for the {site} plant."]
    facts: list[tuple[str, str, str]] = []  # (unit code, part, quantity)
    words = len(lines[0].split())
    budget = approx_tokens / TOKENS_PER_WORD
    for number in itertools.count(1):
        system, part = rng.choice(_SYSTEMS), rng.choice(_PARTS)
        quantity, unit = rng.choice(_QUANTITIES)
        code = f"{system[:2].upper()}-{rng.randint(100, 999)}"
        line = (
            f"{number}. The {part} of {system} {code} runs at a {quantity} of "
            f"{rng.randint(2, 900)} {unit} and is inspected every {rng.randint(2, 12)} "
            f"{rng.choice(_PERIODS)}."
        )
        if facts and words + len(line.split()) > budget:
            break
        lines.append(line)
        words += len(line.split())
        facts.append((f"{system} {code}", part, quantity))
    questions = tuple(
        f"According to the manual, what {quantity} does the {part} of {unit} run at, and how "
        f"often is it inspected?"
        for unit, part, quantity in rng.sample(facts, min(num_questions, len(facts)))
    )
    return CorpusDocument(key, "\n".join(lines), questions)


def ingest_text(tag: str, approx_tokens: int) -> str:
    """A document unique to ``tag`` (deterministic), for upload bursts of fresh content."""
    return make_document(f"ingest-{tag}", approx_tokens, seed=0, num_questions=1).text
