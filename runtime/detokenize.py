"""Streaming detokenization: one token in, the newly completed text out.

Decoding token by token and concatenating is wrong for both tokenizer families we meet:
SentencePiece strips the leading ``▁`` of the first token it decodes (so every piece would lose
its space), and byte-level / byte-fallback tokens can split one UTF-8 character over several
tokens (so a lone token decodes to U+FFFD). The prefix-offset technique (TGI, vLLM) fixes both:
decode a short window of already-emitted tokens plus the new ones, diff against the decode of
the window alone, and emit nothing while the result still ends in U+FFFD.
"""

from __future__ import annotations

import logging

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens kept in the window so the first piece has its context


class IncrementalDetokenizer:
    """Text of a growing token sequence, delivered in pieces.

    Without ``prompt_ids`` the pieces concatenate to ``tokenizer.decode(generated_ids)``. With
    ``prompt_ids`` they continue the prompt's text: they concatenate to
    ``decode(prompt_ids + generated_ids)`` minus ``decode(prompt_ids)`` (so the space before the
    first generated word is kept).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = [int(t) for t in (prompt_ids or [])]
        # ids[prefix_offset:read_offset] is the window already emitted and used as context;
        # ids[read_offset:] are tokens whose text is not out yet.
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _PROMPT_CONTEXT, 0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is partial)."""
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def extend(self, token_ids: list[int]) -> str:
        """Append several tokens (e.g. accepted speculative drafts); return their text."""
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """Return whatever is held back (an unfinished character decodes to U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # special token skipped, or bytes still accumulating
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""
        if not new_text.startswith(prefix_text):
            logger.debug("window decode not prefix-stable: %r -> %r", prefix_text, new_text)
        piece = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return piece

    @property
    def generated_ids(self) -> list[int]:
        """All token ids seen, prompt included."""
        return list(self.ids)
