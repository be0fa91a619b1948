"""Token-in/token-out recording of an OpenAI-style conversation on an episode's trajectory: what
the per-episode ``/v1/chat/completions`` (:mod:`.endpoints`) builds its sample with, and the
rule that a conversation must extend the recorded one (:class:`ConversationDiverged` otherwise)."""

from __future__ import annotations

import asyncio
import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollstream.common.errors import ConfigError, ConversationDiverged, EndpointRefused
from rollstream.producer.episode import Episode, Trajectory, Turn


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or the text of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise EndpointRefused("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise EndpointRefused(f"message content must be a string or a list of text parts, not {type(content).__name__}")


def normalize_message(message: Any, position: int) -> dict[str, Any]:
    """The fields of a chat message that matter to the conversation (clients echo assistant
    messages back with extra null fields: ``refusal``, ``audio``, ``tool_calls: None``, ...)."""
    if not isinstance(message, Mapping):
        raise EndpointRefused(f"messages[{position}] is not an object")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise EndpointRefused(f"messages[{position}] has no role")
    out: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"))}
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str) and message[key]:
            out[key] = message[key]
    tool_calls = message.get("tool_calls")
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def _describe(message: Mapping[str, Any]) -> str:
    text = json.dumps(message, ensure_ascii=False, default=str)
    return text if len(text) <= 200 else text[:197] + "..."


def _common_suffix_prefix(generated: Sequence[int], closing: Sequence[int]) -> int:
    """How many leading ids of ``closing`` the generated ids already end with (an end-of-turn
    token the engine produced and the template also writes)."""
    for k in range(min(len(generated), len(closing)), 0, -1):
        if list(generated[len(generated) - k :]) == list(closing[:k]):
            return k
    return 0


@dataclass
class ChatRecorder:
    """Token-in/token-out recording of one OpenAI-style conversation on an episode trajectory.

    The first request renders its messages with the chat template (generation prompt included):
    when that is the episode's own prompt the episode's main trajectory is used, else a segment
    starting there. Each later request must repeat the recorded conversation (every earlier
    message, and the assistant replies exactly as given) and add messages after it. What is
    appended before the next model turn is the template's text around the new messages (the
    rendering of the whole conversation minus the rendering of the recorded one, plus the end of
    the last assistant message the engine did not produce itself): loss mask 0, log-prob 0. The
    model's tokens are the engine's, never re-tokenized."""

    episode: Episode
    trajectory: Trajectory | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: Any = None
    last_ids: array[int] = field(default_factory=lambda: array("i"))
    turns: int = 0

    def _tokenizer(self) -> Any:
        tokenizer = self.episode.tokenizer
        if tokenizer is None or not hasattr(tokenizer, "chat_text"):
            raise ConfigError("the OpenAI endpoint needs the producer's tokenizer with a chat template (--tokenizer)")
        return tokenizer

    def check_extends(self, messages: list[dict[str, Any]]) -> None:
        recorded = self.messages
        if len(messages) <= len(recorded):
            raise ConversationDiverged(
                f"the conversation does not extend the recorded one: {len(messages)} messages, "
                f"{len(recorded)} recorded; send every earlier message and at least one new one"
            )
        for i, (old, new) in enumerate(zip(recorded, messages, strict=False)):
            if old != new:
                raise ConversationDiverged(
                    f"the conversation does not extend the recorded one: message {i} ({old['role']}) "
                    f"differs: recorded {_describe(old)}, got {_describe(new)}"
                )

    async def turn(self, messages: list[dict[str, Any]], tools: Any, **generate: Any) -> Turn:
        tokenizer = self._tokenizer()
        if self.trajectory is None:
            text = await asyncio.to_thread(tokenizer.chat_text, messages, add_generation_prompt=True, tools=tools)
            ids = await asyncio.to_thread(tokenizer.encode_fragment, text)
            self.tools = tools
            own = self.episode.info.prompt_ids
            if own is not None and tuple(ids) == tuple(own) and self.episode.sample.response_length == 0:
                self.trajectory = self.episode
            else:
                self.trajectory = await self.episode.segment(ids)
        else:
            self.check_extends(messages)
            if tools != self.tools:
                raise ConversationDiverged("the conversation does not extend the recorded one: the tools changed")
            observed = await self._between_turns(tokenizer, messages)
            if observed:
                await self.trajectory.observe(observed)
        turn = await self.trajectory.generate(**generate)
        self.last_ids = array("i", turn.token_ids)
        self.messages = [*messages, {"role": "assistant", "content": turn.text}]
        self.turns += 1
        return turn

    async def _between_turns(self, tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
        """Ids of the template's text from the end of the engine's last tokens to the next
        generation prompt (mask 0)."""
        render = tokenizer.chat_text
        before = await asyncio.to_thread(render, self.messages, add_generation_prompt=False, tools=self.tools)
        after = await asyncio.to_thread(render, messages, add_generation_prompt=True, tools=self.tools)
        if not after.startswith(before):
            raise ConversationDiverged(
                "the chat template renders the extended conversation with a different beginning than the "
                "recorded one (it rewrites earlier turns), so token-in/token-out cannot continue it"
            )
        closing_ids: list[int] = []
        content = self.messages[-1]["content"]
        at = before.rfind(content) if content else -1
        if at >= 0:
            closing_ids = await asyncio.to_thread(tokenizer.encode_fragment, before[at + len(content) :])
            closing_ids = closing_ids[_common_suffix_prefix(self.last_ids, closing_ids) :]
        delta = after[len(before) :]
        delta_ids = await asyncio.to_thread(tokenizer.encode_fragment, delta) if delta else []
        return [*closing_ids, *delta_ids]
