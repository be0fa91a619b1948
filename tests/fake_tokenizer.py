"""A tiny stand-in for a Hugging Face tokenizer (no downloads in tests): ``apply_chat_template``
and ``encode`` over the simulator's byte tokenizer, with a recognisable chat template."""

from __future__ import annotations

from typing import Any


class FakeChatTokenizer:
    """Byte ids; chat rendered as ``[FAKE]role: content|`` per message, then ``[FAKE]assistant:``."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = True,
        tools: Any = None,
        **kwargs: Any,
    ) -> Any:
        text = "".join(f"[FAKE]{m['role']}: {m.get('content') or ''}|" for m in messages)
        if add_generation_prompt:
            text += "[FAKE]assistant:"
        # like transformers 5, answer a mapping: the producer must cope with both shapes
        return {"input_ids": self.encode(text)} if tokenize else text
