"""A model's chat template: chat messages -> the prompt token ids the model was tuned on.

The runtime tokenizer is a plain `tokenizers.Tokenizer`, which knows no chat template; the
template travels in the artifact as `chat_template.jinja` or as `chat_template` inside
`tokenizer_config.json` (the exporter copies both). It is rendered the way Hugging Face's
`apply_chat_template` renders it (sandboxed jinja2, trim/lstrip blocks, `raise_exception`,
the special tokens as variables, add_generation_prompt=True), and the text is tokenized
without adding special tokens, because the template writes BOS itself.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from specport.core.errors import InputError

logger = logging.getLogger(__name__)


class ChatTemplate:
    """The artifact's chat template (jinja, as Hugging Face renders it) -> prompt token ids.

    The runtime tokenizer is a plain `tokenizers.Tokenizer`, which has no chat template; the
    template travels in the artifact as `chat_template.jinja` or inside `tokenizer_config.json`.
    A tokenizer that has `apply_chat_template` (a transformers tokenizer) is used directly.
    """

    def __init__(self, tokenizer: Any, source: str | None, special: dict[str, str]) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.special = special
        self._compiled: Any = None
        if source is not None:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
            self._compiled = env.from_string(source)

    def render(self, messages: list[dict[str, str]]) -> str:
        return str(
            self._compiled.render(messages=messages, add_generation_prompt=True, **self.special)
        )

    def render_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if self._compiled is None:  # a transformers tokenizer
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        # the template writes BOS and friends itself, as with HF apply_chat_template
        return list(self.tokenizer.encode(self.render(messages), add_special_tokens=False).ids)

    def user_prefix_ids(self) -> list[int]:
        """The ids a conversation starts with up to where the first user message's text
        begins (the template's BOS, default system message and user header): what an
        instruction-tuned model continues with a user's request."""
        marker = "\x1fspecport-user-message\x1f"
        messages = [{"role": "user", "content": marker}]
        hf = self._compiled is None  # a transformers tokenizer renders its own template
        text = str(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            if hf
            else self.render(messages)
        )
        if marker not in text:
            raise InputError(
                "the chat template does not write a user message's text as given, so there is "
                "no user header to continue; pass --data FILE instead."
            )
        prefix = text[: text.index(marker)]
        if hf:
            return [int(t) for t in self.tokenizer.encode(prefix, add_special_tokens=False)]
        return list(self.tokenizer.encode(prefix, add_special_tokens=False).ids)


def _raise_template_error(message: str) -> None:
    raise InputError(f"the chat template refused these messages: {message}")


def load_chat_template(model: Any, override: str | None = None) -> ChatTemplate | None:
    """The model's chat template, or None when it has none (or no tokenizer).

    `override` (a template's text, e.g. `serve --chat-template FILE`) replaces the artifact's,
    for models published without one; the special tokens still come from the artifact."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        return None
    if override is None and (
        hasattr(tokenizer, "apply_chat_template") and getattr(tokenizer, "chat_template", None)
    ):
        return ChatTemplate(tokenizer, None, {})
    directory = Path(model.path)
    config: dict[str, Any] = {}
    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            logger.warning("could not read %s: %s", cfg_path, e)
    source: Any = override
    jinja = directory / "chat_template.jinja"
    if source is not None:
        pass
    elif jinja.is_file():
        source = jinja.read_text(encoding="utf-8")
    else:
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
    if not isinstance(source, str) or not source.strip():
        return None
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        special[key] = value if isinstance(value, str) else ""
    return ChatTemplate(tokenizer, source, special)
