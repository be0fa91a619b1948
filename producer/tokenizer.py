"""Prompt tokenizers: turn text and chat messages into prompt token ids on the producer.

With a tokenizer the producer sends ``input_ids`` to every engine API, so chat prompts work on
SGLang's native ``/generate`` (which takes no messages) and samples always carry prompt ids.

``--tokenizer`` takes a Hugging Face name or path (needs the optional ``transformers`` extra;
loaded by the producer before its heartbeat says ``running``, so the first prompt does not wait
for it, or on first use by other callers) or
``module:attribute``, an object (or a zero-argument factory of one) with
``apply_chat_template(messages, tokenize=True, add_generation_prompt=True)`` and ``encode(text)``
like a Hugging Face tokenizer: a way to plug in a custom tokenizer, and the test seam.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from rollstream.common.checked import is_int
from rollstream.common.errors import ConfigError
from rollstream.common.imports import import_object

logger = logging.getLogger(__name__)

_OBJECT_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _as_ids(value: Any, what: str) -> list[int]:
    """Token ids from what tokenizers return: a list, a nested batch of one, or a mapping."""
    if isinstance(value, Mapping):
        value = value.get("input_ids")
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, Sequence) and value and isinstance(value[0], Sequence):
        if len(value) != 1:
            raise ValueError(f"{what} returned a batch of {len(value)} sequences, expected one")
        value = value[0]
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise ValueError(f"{what} returned {type(value).__name__}, not token ids")
    ids = list(value)
    if not all(is_int(t) for t in ids):
        raise ValueError(f"{what} returned non-integer token ids")
    return ids


class PromptTokenizer:
    """Wraps a Hugging Face-like tokenizer object (loaded lazily from a name, or given)."""

    def __init__(self, source: str | None = None, *, tokenizer: Any = None) -> None:
        if (source is None) == (tokenizer is None):
            raise ConfigError("give exactly one of a tokenizer name/path and a tokenizer object")
        self.source = source or type(tokenizer).__name__
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        if tokenizer is None and importlib.util.find_spec("transformers") is None:
            raise ConfigError(
                f"--tokenizer {source} needs the 'transformers' package: "
                "pip install 'rollstream[transformers]' (or pass module:attribute for a custom tokenizer)"
            )

    def _get(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer  # the optional extra, imported on first use

                logger.info("loading tokenizer %s", self.source)
                self._tokenizer = AutoTokenizer.from_pretrained(self.source)
            return self._tokenizer

    def load(self) -> None:
        """Load the tokenizer now (blocking: call it in a thread from asyncio code)."""
        self._get()

    def encode(self, text: str) -> list[int]:
        """Prompt ids of a text prompt (with the special tokens the engine would add)."""
        return _as_ids(self._get().encode(text), f"tokenizer {self.source}.encode")

    def encode_fragment(self, text: str) -> list[int]:
        """Ids of a piece of a longer sequence (tool output, chat markup): no special tokens added."""
        tokenizer = self._get()
        try:
            ids = tokenizer.encode(text, add_special_tokens=False)
        except TypeError:  # a custom tokenizer without the keyword
            ids = tokenizer.encode(text)
        return _as_ids(ids, f"tokenizer {self.source}.encode")

    def chat_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The chat template's text for ``messages`` (the OpenAI endpoint diffs two renderings)."""
        tokenizer = self._get()
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ConfigError(f"tokenizer {self.source} has no apply_chat_template")
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kwargs["tools"] = list(tools)
        text = tokenizer.apply_chat_template(list(messages), **kwargs)
        if not isinstance(text, str):
            raise ValueError(
                f"tokenizer {self.source}.apply_chat_template(tokenize=False) returned {type(text).__name__}"
            )
        return text

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Prompt ids of chat messages rendered with the model's chat template."""
        tokenizer = self._get()
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ConfigError(f"tokenizer {self.source} has no apply_chat_template")
        rendered = tokenizer.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
        return _as_ids(rendered, f"tokenizer {self.source}.apply_chat_template")


def load_tokenizer(spec: str) -> PromptTokenizer:
    """A tokenizer from ``--tokenizer``: ``module:attribute`` or a Hugging Face name or path."""
    if not spec or not spec.strip():
        raise ConfigError("--tokenizer needs a name, a path or module:attribute")
    if _OBJECT_SPEC.match(spec):
        obj = import_object(spec, "--tokenizer")
        if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "encode")):
            obj = obj()
        if not hasattr(obj, "encode"):
            raise ConfigError(f"--tokenizer {spec}: the object has no encode()")
        return PromptTokenizer(tokenizer=obj)
    return PromptTokenizer(spec)
