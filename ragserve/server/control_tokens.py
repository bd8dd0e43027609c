"""User text never becomes control tokens, while chat templates still write the real ones.

A control token is a special added token (``<|im_start|>``, ``<|eot_id|>``, ...). Text from
users is encoded with special-token strings read as plain text (``split_special_tokens``:
the same setting encodes uploaded documents, whole completion prompts and this). A chat
template's output mixes the template's own control tokens with user content, so:

1. :meth:`ControlTokenGuard.mark` wraps every control-token string in the messages' content
   in markers holding a fresh random nonce (a user cannot forge or break them);
2. the template renders the marked messages as usual;
3. :meth:`ControlTokenGuard.encode` splits the rendered text at the markers: marked pieces
   are encoded as plain text, the rest (template text, control tokens and ordinary content)
   as before. Without marks (content holding no control-token string) this is exactly the
   old, single encoding of the rendered text.

Lone markers (a template that splits content with string methods) are dropped but still
break the text, so the text on either side cannot join into a control token. Special
tokens are matched as exact strings, as tokenizers match them unless an added token is
marked ``normalized`` (no chat model's control tokens are).
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Marks:
    """The markers of one rendering and the pattern that splits the rendered text at them."""

    open: str
    close: str
    splitter: re.Pattern[str]


class ControlTokenGuard:
    """Marks and encodes chat messages for one tokenizer.

    ``tokenizer`` reads special-token strings as control tokens; ``plain`` is a copy set to
    read them as text. Both are only read, never reconfigured, so threads may share them.
    """

    def __init__(self, tokenizer: Any, plain: Any) -> None:
        self.tokenizer = tokenizer
        self.plain = plain
        specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
        # NOTE: longest first, so a token that contains another is matched whole.
        ordered = sorted(specials, key=len, reverse=True)
        self._alternatives = "|".join(re.escape(token) for token in ordered)
        self._pattern = re.compile(self._alternatives) if ordered else None
        self.special_ids = frozenset(int(i) for i in tokenizer.convert_tokens_to_ids(ordered))
        self._newline_ids = self._encode("\n", as_text=False)
        if any(t.special and t.normalized for t in tokenizer.added_tokens_decoder.values()):
            logger.warning(
                "this tokenizer matches some special tokens after normalizing text; chat "
                "content is guarded against their exact spellings only"
            )

    def mark(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], Marks | None]:
        """The messages with each control-token string in their content between fresh
        markers, and those markers; the messages unchanged and None when there are none."""
        pattern = self._pattern
        if pattern is None or not any(pattern.search(m["content"]) for m in messages):
            return messages, None
        nonce = secrets.token_hex(8)
        open_, close = f"\x00{nonce}<", f">{nonce}\x00"
        marked = [
            {**m, "content": pattern.sub(lambda hit: open_ + hit.group(0) + close, m["content"])}
            for m in messages
        ]
        o, c = re.escape(open_), re.escape(close)
        splitter = re.compile(f"{o}({self._alternatives}){c}|{o}|{c}")
        return marked, Marks(open_, close, splitter)

    def encode(self, rendered: str, marks: Marks | None) -> list[int]:
        """Token ids of text rendered from messages that :meth:`mark` returned."""
        if marks is None:
            return self._encode(rendered, as_text=False)
        # [text, marked token, text, marked token, ..., text]; None for a lone marker.
        pieces = marks.splitter.split(rendered)
        ids = self._encode(pieces[0], as_text=False)
        for index, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += self._encode_inner(piece, as_text=index % 2 == 1)
        return ids

    def _encode(self, text: str, as_text: bool) -> list[int]:
        tokenizer = self.plain if as_text else self.tokenizer
        return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _encode_inner(self, piece: str, as_text: bool) -> list[int]:
        """``piece`` as it encodes in the middle of a text.

        NOTE: SentencePiece-style tokenizers give the start of a text a prefix space; after
        a newline they do not, so the piece is encoded behind one that is then removed.
        """
        ids = self._encode("\n" + piece, as_text)
        newline = self._newline_ids
        if ids[: len(newline)] == newline:
            return ids[len(newline) :]
        return self._encode(piece, as_text)
