"""How to reach the engines and what to ask them for, and the reply bound derived from it."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollstream.common.backoff import Backoff
from rollstream.common.checked import is_int
from rollstream.common.errors import ConfigError
from rollstream.common.settings_fields import option, set_by
from rollstream.common.urls import check_url

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

    urls: tuple[str, ...] = option(
        (), flag="--engine", parse=str, repeat=True, convert=tuple, metavar="URL",
        help="engine URL (repeatable; or --engines-from-registry)")
    """The ``--engine`` URLs (may be empty when ``registry_urls`` are given)."""
    api: str = option(
        "sglang", flag="--engine-api", choices=ENGINE_APIS,
        help="the engines' API; vllm: vLLM's /inference/v1/generate (token ids, weight version spans)")
    """An engine API: a key of :data:`~.dialects.DIALECTS`."""
    model: str | None = option(None, parse=str, help="model name (OpenAI-compatible engines; required there)")
    max_new_tokens: int = option(1024, stored=True, help="tokens one sample may generate at most")
    temperature: float = option(1.0, stored=True, help="sampling temperature")
    top_p: float = option(1.0, stored=True, help="nucleus sampling's top-p")
    sampling_params: Mapping[str, Any] = set_by("the run's stored rollout flags (their sampling_params)", factory=dict)
    """Extra sampling parameters passed through as they are."""
    request_timeout: float = option(
        3600.0, help="seconds one engine request may take in total, reply body included")
    """Not per read: past it the sample fails with :class:`EngineReplyInvalid` ``deadline``."""
    connect_timeout: float = option(5.0, help="seconds to connect to an engine")
    max_reply_bytes: int | None = option(
        None, flag="--max-reply-mib", parse=float, convert=lambda mib: int(mib * 2**20),
        help="largest engine reply accepted, in MiB (checked while reading); default: derived per request "
             "from --max-new-tokens, n and log-probs (docs/engines.md)")
    """Larger fails the sample. None (the default): derived per request from what it can
    legitimately return (:func:`reply_byte_bound`), so the replies in flight take at most about
    ``concurrency`` x the bound of one sample."""
    max_retries: int = option(5, help="engine retries per request")
    backoff_base: float = option(0.2, flag="--retry-backoff", help="seconds before an engine request's first retry")
    backoff_max: float = option(10.0, flag="--retry-backoff-max", help="the most seconds between two retries")
    max_connections: int = option(512, help="HTTP connections to the engines at most")
    model_info_timeout: float = option(2.0, help="seconds to wait for an engine's weight version")
    model_info_ttl: float = option(5.0, help="seconds an engine's weight version is believed before it is re-read")
    return_logprob: bool = option(True, help="ask the engines for each sampled token's log-prob")
    request_seed: bool = option(
        False, help="send a random per-request seed (vllm API; kills vLLM's CPU engine on reschedule)")
    """Off: a seeded request that the CPU engine reschedules (pause ``keep``, the recompute after
    a weight reload) kills it."""
    routed_experts: tuple[int, int, int] | None = option(
        None, parse=lambda value: parse_moe_shape(value), metavar="LAYERSxTOPKxEXPERTS",
        help="ask the engine for the MoE routing replay (R3: SGLang's return_routed_experts, vLLM's "
             "choices[].routed_experts with --engine-api vllm; the server runs with "
             "--enable-return-routed-experts), e.g. 48x8x128; checked against this shape")
    """See producer/engine/vllm_replay.py for vLLM's form."""
    engine_stats: bool = option(
        False, help="record SGLang's prefix-cache and speculative-decoding counters per sample (wire format v3)")
    health_interval: float = option(
        2.0, help="seconds between the engine monitor's probes of engines in trouble (docs/engines.md)")
    health_timeout: float = option(
        5.0, help="seconds: an engine whose /health gives no answer this long while its requests wait is wedged")
    eject_after: int = option(
        3, help="failed requests in a row (5xx, unusable replies) that take an engine out of routing")
    """A refused or reset connection takes it out at once. Never the last routed engine."""
    balance: float = option(
        0.25, flag="--route-balance", help="cache-aware routing keeps each engine within (1 + this) x the mean load")
    no_engine_timeout: float = option(
        120.0, help="seconds a request waits while no engine is usable before the producer fails")
    drain_timeout: float = option(
        300.0, flag="--engine-drain-timeout",
        help="seconds a drained engine's requests may still run before they are retried elsewhere")
    adaptive_concurrency: bool = option(
        True, help="limit each engine's samples in flight by its own load (KV usage, preemptions), between "
                   "--concurrency-floor and --concurrency (docs/engines.md)")
    """See ``load.py``."""
    concurrency_floor: int = option(4, help="the least samples in flight an engine's adaptive limit allows")
    load_interval: float = option(1.0, help="seconds between readings of each engine's load (adaptive concurrency)")
    catch_up: bool = option(
        False, flag="--catch-up-engines",
        help="load the trainer's recorded weights (WeightSync.update, GroupConsumer.record_weights) into "
             "an engine found behind, then let it rejoin (docs/engines.md)")
    """From ``Keys.weights``."""
    registry_urls: tuple[str, ...] = set_by("the engine registry, with --engines-from-registry and no --engine", ())
    """Dropped once the registry forgets them, as engines that join later."""

    def __post_init__(self) -> None:
        if not self.urls and not self.registry_urls:
            raise ConfigError("at least one engine URL is needed (--engine URL, or --engines-from-registry)")
        # One check for every URL that reaches the fleet (common/urls.py), normalised here.
        object.__setattr__(self, "urls", tuple(check_url(u) for u in self.urls))
        object.__setattr__(self, "registry_urls", tuple(check_url(u) for u in self.registry_urls))
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
        if not is_int(self.concurrency_floor) \
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


def parse_moe_shape(value: str) -> tuple[int, int, int]:
    """``LAYERSxTOPKxEXPERTS`` (e.g. ``48x8x128``) as three positive ints (argparse type)."""
    parts = value.lower().split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not LAYERSxTOPKxEXPERTS (e.g. 48x8x128)")
    return (shape[0], shape[1], shape[2])
