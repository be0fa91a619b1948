"""What every part of the engine client shares: the sample type, the request, the dialect seam.

:class:`Generation` is one sample of an engine reply, normalised across APIs: the dialects'
parsers build it straight from the reply bytes, the client then names the engine and fills in a
weight version the reply did not carry. :class:`Dialect` is what an engine API implements (one
module per API: :mod:`.sglang`, :mod:`.openai`, :mod:`.vllm`): it only translates, a request into
an :class:`Encoded` (path, body, what the reply may hold) and the reply's bytes into generations,
and declares the endpoints its servers answer beside generation (versions, load, abort, weights);
the client alone sends, retries, blames an engine and records versions.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rollstream.common.arrays import Packed

if TYPE_CHECKING:
    from rollstream.common.weight_apis import Call, WeightAPI

    from .load import LoadEndpoint
    from .settings import EngineSettings

Messages = Sequence[Mapping[str, Any]]


@dataclass(slots=True)
class Generation:
    """One engine reply (one sample), normalised across APIs."""

    text: str
    output_ids: array[int]
    """Packed ``array('i')`` (a sequence: ``len``, indexing and iteration work as on a list)."""
    log_probs: array[float] | None
    """Packed ``array('f')`` of the sampled tokens' log-probs; None when not asked for."""
    finish_reason: str | None
    weight_version: int | None = None
    """From the reply when it says (SGLang ``meta_info.weight_version``, vLLM's last span), else
    from the engine's model-info endpoint; None when neither says."""
    engine: str = ""
    """The engine's URL (without credentials)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt_ids: array[int] | None = None
    """Prompt token ids as the engine saw them, when it says (vLLM ``return_token_ids``)."""
    weight_version_spans: list[tuple[int, int, int]] | None = None
    """``(version, start, end)`` over the output tokens, from the engine (vLLM API); None when it
    did not say or a version is not an integer. ``weight_version`` is then the last span's version."""
    weight_version_before: int | None = None
    """Set when the reply carried no version and the engine's version read before the request
    differs from the one read after it: the weights changed while it ran and nothing says where
    (``weight_version`` is the one after; the sample records both, oldest first)."""
    routed_experts: Packed | None = None
    """The routing replay of the request's whole sequence (input + output - 1 rows) after
    ``routed_experts_start`` rows, when asked for (``EngineSettings.routed_experts``)."""
    routed_experts_start: int = 0
    counters: dict[str, int] | None = None
    """The engine's prefix-cache / speculative-decoding counters of this request (SGLang)."""
    prefix_cache: tuple[int, int] | None = None
    """``(prompt tokens, of them cached)`` when the engine says (SGLang ``meta_info``): the fleet's hit rate."""


@dataclass(slots=True)
class Request:
    """One generation as the client hands it to a dialect (exactly one of text, ids, messages)."""

    n: int
    text: str | None
    input_ids: Sequence[int] | None
    messages: Messages | None
    max_new_tokens: int
    sampling: Mapping[str, Any]
    """Sampling parameters without the length limit."""
    rid: str | None = None
    image_data: Sequence[str] | None = None
    key: str | None = None
    """The routing key (the group's): its samples and turns go to one engine (:mod:`.fleet`)."""


@dataclass(frozen=True, slots=True)
class Encoded:
    """A request as a dialect writes it: where it goes, its body, and what its reply may hold
    (the client derives the reply bound from it, :meth:`~.client.EngineClient.reply_limit`)."""

    path: str
    body: dict[str, Any]
    weight: int = 1
    """Samples it asks for."""
    prompt_tokens: int = 0
    """Prompt tokens the reply echoes, ``prompt_copies`` times."""
    prompt_copies: int = 0
    replay_prompt_tokens: int = 0
    """Prompt tokens the routing replay covers (one row each)."""


class Dialect(Protocol):
    """An engine API, declared whole in its module: how a request is written and a reply read
    (pure functions; transport, retries, blame and versions are the client's), and the endpoints
    the client's monitor, the catch-up and the abort use."""

    name: str
    """Its ``--engine-api`` value."""
    needs_token_ids: bool
    """Whether prompts go as token ids (the client tokenizes text and chat messages first)."""
    needs_model: bool
    """Whether requests name the model (``--model``)."""
    replies_carry_versions: bool
    """Whether replies carry the weight version (else it is read from ``version_paths``)."""
    routing_replay: bool
    """Whether the API returns the routing replay (``--routed-experts``)."""
    seed_reschedule_kills: bool
    """Whether a per-request seed kills the engine when it reschedules the request (vLLM's CPU engine)."""
    batches_samples: bool
    """Whether one request asks for a group's ``n`` samples (else ``n`` requests)."""
    accepts_messages: bool
    """Whether chat messages can be sent as they are."""

    version_paths: tuple[str, ...]
    """Model-info endpoints with a ``weight_version``, tried in order (a 404 tries the next)."""
    version_hint: str
    """Which engine gives versions on this API: the start-up warning about an engine that gives none."""
    loads: tuple[LoadEndpoint, ...]
    """The engine's own load endpoints and their parsers, tried in order (:mod:`.load`)."""
    abort: Call
    """``POST`` that aborts every request in flight on one engine."""
    weights: WeightAPI
    """The server's weight-update endpoints (``common/weight_apis.py``, shared with the trainer's
    ``WeightSync``): the catch-up of an engine found behind sends ``weights.catch_up_requests``."""

    def encode(self, request: Request, settings: EngineSettings) -> Encoded:
        """The request to send (``PromptNotSupported`` for a prompt this API cannot take)."""

    def decode(self, encoded: Encoded, raw: bytes, settings: EngineSettings, where: str) -> list[Generation]:
        """The samples of a reply to ``encoded`` (``EngineReplyInvalid`` when unusable; ``where``
        names the URL on errors)."""
