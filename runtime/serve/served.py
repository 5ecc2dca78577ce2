"""`ServedModel`: what the server's protocol layer knows about the model behind it.

Below both the request rules (`protocol`) and the field checks they call (`fields`), which
read it, so those two do not import each other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from specport.runtime.grammar import GrammarCompiler


@dataclass
class ServedModel:
    """What the protocol layer needs to know about the model behind the server."""

    name: str
    model: Any  # specport.api.Model: encode, decode, tokenizer, manifest, path
    created: int = field(default_factory=lambda: int(time.time()))
    engine_max_length: int | None = None  # KV positions per request the engine reserves
    logprobs: bool = True  # the engine reports logprobs (both of ours do)
    speculative: bool = False  # the serial engine decodes speculatively (grammars: greedy only)
    max_tokens: int | None = None  # the operator's default and cap (`serve --max-tokens`)
    _grammars: Any = None

    def grammars(self) -> Any:
        """The structured-output compiler for this tokenizer (built at first use, ~1 s)."""
        if self._grammars is None:
            m = self.model.manifest
            self._grammars = GrammarCompiler(self.model.tokenizer, m.vocab_size, m.eos_token_ids)
        return self._grammars

    @property
    def context_length(self) -> int:
        m = self.model.manifest
        limit = m.kv.max_length if m.kv.layout == "shared" else None
        length = min(m.context_length, limit or m.context_length)
        return int(min(length, self.engine_max_length or length))

    @property
    def vocab_size(self) -> int:
        return int(self.model.manifest.vocab_size)
