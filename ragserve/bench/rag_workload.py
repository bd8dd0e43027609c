"""The RAG workload: a pool of factual documents, and questions over 4 to 8 of them drawn
in a fresh random order each, as token ids with the documents' spans.

Documents are tokenized on their own and joined as ids (as the server does), so a document
is the same tokens wherever it stands. Text is synthetic but natural (registers of who did
what, where and when), so a real model's answers depend on the documents' content.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

NAMES = ["Mara", "Tomas", "Lena", "Iker", "Sofia", "Ravi", "Anouk", "Petra", "Hugo", "Nadia"]
SURNAMES = ["Quist", "Vell", "Ortiz", "Brandt", "Okafor", "Lindqvist", "Moreau", "Sato", "Kerr"]
CITIES = ["Dunmore", "Kellbridge", "Ashford", "Port Selby", "Varna", "Lowick", "Tamsin"]
THINGS = ["lighthouse", "bakery", "bridge", "library", "observatory", "mill", "harbour wall"]
VERBS = ["built", "repaired", "painted", "sold", "inspected", "opened", "restored"]
HEAD = (
    "<|im_start|>system\nAnswer the question from the documents. Be brief.<|im_end|>\n"
    "<|im_start|>user\n"
)


@dataclass(frozen=True)
class RagQuestion:
    """One prompt: ``token_ids`` = head + documents (in ``order``) + question."""

    token_ids: list[int]
    spans: list[tuple[int, int]]
    order: list[int]  # indices into the pool
    text: str


def _sentence(rng: random.Random) -> tuple[str, str]:
    who = f"{rng.choice(NAMES)} {rng.choice(SURNAMES)}"
    verb, thing, city = rng.choice(VERBS), rng.choice(THINGS), rng.choice(CITIES)
    year = rng.randint(1800, 1999)
    fact = f"In {year}, {who} {verb} the {thing} of {city}."
    question = f"Who {verb} the {thing} of {city} in {year}?"
    return fact, question


def make_pool(
    tokenizer: Any, num_docs: int, doc_tokens: int, seed: int = 0
) -> tuple[list[list[int]], list[list[str]]]:
    """``num_docs`` documents of about ``doc_tokens`` tokens each (token ids, and each
    document's questions)."""
    rng = random.Random(seed)
    docs, questions = [], []
    for number in range(num_docs):
        text, asks = f"Document {number + 1}.\n", []
        while len(tokenizer.encode(text)) < doc_tokens:
            fact, question = _sentence(rng)
            text += fact + " "
            asks.append(question)
        docs.append(encode(tokenizer, text.strip() + "\n\n"))
        questions.append(asks)
    return docs, questions


def make_questions(
    tokenizer: Any,
    docs: list[list[int]],
    asks: list[list[str]],
    count: int,
    docs_per_question: tuple[int, int] = (4, 8),
    seed: int = 1,
) -> list[RagQuestion]:
    """``count`` questions, each over a random number of pool documents in a random order,
    about a fact of one of them."""
    rng = random.Random(seed)
    head = encode(tokenizer, HEAD)
    out = []
    for _ in range(count):
        k = rng.randint(*docs_per_question)
        order = rng.sample(range(len(docs)), min(k, len(docs)))
        target = rng.choice(order)
        text = rng.choice(asks[target])
        ids, spans = list(head), []
        for index in order:
            spans.append((len(ids), len(ids) + len(docs[index])))
            ids += docs[index]
        ids += encode(tokenizer, f"Question: {text}<|im_end|>\n<|im_start|>assistant\n")
        out.append(RagQuestion(ids, spans, order, text))
    return out


def encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def random_workload(
    vocab_size: int, num_docs: int, doc_tokens: int, count: int, docs_per_question: tuple[int, int]
) -> tuple[list[list[int]], list[RagQuestion]]:
    """The pool and questions of the same shape in random token ids, for models without a tokenizer
    (random weights of a real shape: speed only)."""
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(n)]

    head, docs = ids(24), [ids(doc_tokens) for _ in range(num_docs)]
    out = []
    for _ in range(count):
        order = rng.sample(range(num_docs), min(rng.randint(*docs_per_question), num_docs))
        tokens, spans = list(head), []
        for index in order:
            spans.append((len(tokens), len(tokens) + doc_tokens))
            tokens += docs[index]
        out.append(RagQuestion(tokens + ids(20), spans, order, ""))
    return docs, out
