"""How to reach the engines and what to ask them for, and the reply bound derived from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollstream.common.backoff import Backoff
from rollstream.common.errors import ConfigError

from .dialects import DIALECTS

ENGINE_APIS = tuple(DIALECTS)
"""``--engine-api`` values: one per dialect module."""

REPLY_BASE_BYTES = 256 * 2**10
"""Reply bound, per request: the envelope and metadata (usage, ids, finish reasons; < 2 KiB
in practice), and the margin of short replies."""
REPLY_TOKEN_BYTES = 96
"""Per output token: its id (``output_ids`` / ``token_ids``, <= 11 bytes) and its text,
JSON-escaped (typically 1-8 bytes; a long whitespace or code token more)."""
REPLY_LOGPROB_BYTES = 256
"""Per output token with log-probs asked for: SGLang's ``[logprob, id, null]`` (~25 bytes), vLLM's
``"token_id:N"`` token, log-prob, offset and top-log-prob entry (~80), or a chat log-prob object
with the token's ``bytes`` (~100, more for long tokens)."""
REPLY_PROMPT_TOKEN_BYTES = 12
"""Per prompt token echoed back (vLLM ``return_token_ids``: the reply's and each choice's
``prompt_token_ids``)."""


def reply_byte_bound(
    *, max_new_tokens: int, n: int, log_probs: bool, prompt_tokens: int = 0, prompt_copies: int = 0,
    extra_bytes_per_token: int = 0,
) -> int:
    """The most bytes a legitimate reply to one request can hold, with a margin (about 3x what
    SGLang and vLLM send for typical tokens): ``n`` samples of ``max_new_tokens`` each, their
    log-probs when asked for, ``prompt_copies`` echoes of a ``prompt_tokens`` prompt. The one
    place the default bound is derived: per-token data asked for beside the tokens (routed
    experts, teacher log-probs) adds ``extra_bytes_per_token``."""
    per_token = REPLY_TOKEN_BYTES + (REPLY_LOGPROB_BYTES if log_probs else 0) + extra_bytes_per_token
    return REPLY_BASE_BYTES + n * max_new_tokens * per_token + prompt_copies * prompt_tokens * REPLY_PROMPT_TOKEN_BYTES


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """How to reach the engines and what to ask them for."""

    urls: tuple[str, ...]
    """The ``--engine`` URLs (may be empty when ``registry_urls`` are given)."""
    api: str = "sglang"
    """An engine API: a key of :data:`~.dialects.DIALECTS`."""
    model: str | None = None
    """Model name for OpenAI-compatible servers (required there)."""
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    """Extra sampling parameters passed through as they are."""
    request_timeout: float = 3600.0
    """Seconds one generation request may take in total, body included (not per read); past
    it the sample fails with :class:`EngineReplyInvalid` ``deadline``."""
    connect_timeout: float = 5.0
    max_reply_bytes: int | None = None
    """Largest reply body accepted (bytes, checked while reading); larger fails the sample.
    None (the default): derived per request from what it can legitimately return
    (:func:`reply_byte_bound`), so the replies in flight take at most about ``concurrency`` x
    the bound of one sample."""
    max_retries: int = 5
    backoff_base: float = 0.2
    backoff_max: float = 10.0
    max_connections: int = 512
    model_info_timeout: float = 2.0
    model_info_ttl: float = 5.0
    return_logprob: bool = True
    request_seed: bool = False
    """Send a random per-request ``seed`` (vLLM API only). Off: a seeded request that the CPU
    engine reschedules (pause ``keep``, the recompute after a weight reload) kills it."""
    routed_experts: tuple[int, int, int] | None = None
    """``(layers, topk, experts)``: ask for the routing replay (SGLang ``return_routed_experts``;
    vLLM sends ``choices[].routed_experts`` unasked, see producer/engine/vllm_replay.py; both servers
    run with ``--enable-return-routed-experts``) and check it against this shape."""
    engine_stats: bool = False
    """Record SGLang's prefix-cache and speculative-decoding counters per sample (``spec_info``,
    ``prefix_cache_info``: wire format v3)."""
    health_interval: float = 2.0
    """Seconds between the fleet monitor's rounds (probes of engines in trouble, see ``fleet.py``)."""
    health_timeout: float = 5.0
    """A ``/health`` probe unanswered this long, while requests wait on the engine: wedged."""
    eject_after: int = 3
    """Failed requests in a row (5xx, unusable replies) that take an engine out of routing;
    a refused or reset connection takes it out at once. Never the last routed engine."""
    balance: float = 0.25
    """Bounded load of cache-aware routing: no engine above ``(1 + balance)`` x the mean."""
    no_engine_timeout: float = 120.0
    """Seconds a request waits for a routed engine (all out, probed) before it fails: fatal."""
    drain_timeout: float = 300.0
    """Seconds a drained engine's requests may still run before they are retried elsewhere."""
    adaptive_concurrency: bool = True
    """Limit each engine's samples in flight by its own load (KV usage, waiting requests,
    preemptions), between ``concurrency_floor`` and the producer's concurrency (see ``load.py``)."""
    concurrency_floor: int = 4
    load_interval: float = 1.0
    """Seconds between readings of each engine's load (with ``adaptive_concurrency``)."""
    catch_up: bool = False
    """Load the trainer's recorded weights (``Keys.weights``) into an engine found behind, then
    let it rejoin (``--catch-up-engines``)."""
    registry_urls: tuple[str, ...] = ()
    """Engines from the engine registry at start (``--engines-from-registry`` without
    ``--engine``): dropped once the registry forgets them, as engines that join later."""

    def __post_init__(self) -> None:
        if not self.urls and not self.registry_urls:
            raise ConfigError("at least one engine URL is needed (--engine URL, or --engines-from-registry)")
        for url in (*self.urls, *self.registry_urls):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"engine URL must start with http:// or https://, got {url!r}")
        if self.api not in ENGINE_APIS:
            raise ConfigError(f"engine api must be one of {', '.join(ENGINE_APIS)}, got {self.api!r}")
        dialect = DIALECTS[self.api]
        if dialect.seed_reschedule_kills and "seed" in self.sampling_params:
            raise ConfigError(
                f"a per-request seed kills {self.api}'s CPU engine when the request is rescheduled (pause keep, "
                "a weight reload): drop 'seed' from sampling_params (or use request_seed=True knowingly)"
            )
        if dialect.needs_model and not self.model:
            raise ConfigError(f"--engine-api {self.api} needs --model NAME")
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ConfigError("temperature must be non-negative")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p must be in (0, 1]")
        if self.max_reply_bytes is not None and self.max_reply_bytes < 1024:
            raise ConfigError("max_reply_bytes must be at least 1024")
        if self.max_retries < 0:
            raise ConfigError("max_retries must be non-negative")
        Backoff(self.backoff_base, self.backoff_max)  # ConfigError unless 0 < base <= max
        if self.eject_after < 1:
            raise ConfigError("eject_after must be at least 1")
        if self.balance < 0:
            raise ConfigError("balance must be non-negative")
        if isinstance(self.concurrency_floor, bool) or not isinstance(self.concurrency_floor, int) \
                or self.concurrency_floor < 1:
            raise ConfigError(f"concurrency_floor must be a positive integer, got {self.concurrency_floor!r}")
        for name in ("request_timeout", "connect_timeout", "model_info_timeout", "backoff_max", "health_interval",
                     "health_timeout", "no_engine_timeout", "drain_timeout", "load_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.routed_experts is not None:
            if len(self.routed_experts) != 3 or any(not isinstance(v, int) or v < 1 for v in self.routed_experts):
                raise ConfigError(f"routed_experts must be (layers, topk, experts) >= 1, got {self.routed_experts!r}")
            if not dialect.routing_replay:
                replay = " or ".join(name for name, d in DIALECTS.items() if d.routing_replay)
                raise ConfigError(f"--routed-experts needs --engine-api {replay} (the replay's endpoints)")

    @property
    def all_urls(self) -> tuple[str, ...]:
        """The engines given at start: ``--engine`` URLs (credentials included: redact before
        showing them) and the registry's."""
        return (*self.urls, *self.registry_urls)

    @property
    def backoff(self) -> Backoff:
        """The retry delays: from ``backoff_base`` seconds, at most ``backoff_max``, jittered."""
        return Backoff(self.backoff_base, self.backoff_max)
