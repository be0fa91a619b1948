"""The inference-engine client: transport below, one dialect module per engine API above.

* :mod:`.transport`: the HTTP contract (bounded reads, the total deadline, URL credentials; any
  ``httpx`` transport for tests); :mod:`.http11`: the default, keep-alive HTTP/1.1 on
  ``asyncio.Protocol`` with its connection pool.
* :mod:`.client`: :class:`EngineClient`, retries on :class:`~rollstream.common.backoff.Backoff`,
  the fleet monitor, and what the producer calls (generate, tokenize, weight version, abort,
  the registry); :mod:`.fleet`: each engine's state and the cache-aware routing with bounded
  loads; :mod:`.discovery`: model-info versions and gateway workers.
* dialects (:mod:`.dialects` names them): :mod:`.sglang` (native ``/generate``), :mod:`.openai`
  (``/v1/completions``, ``/v1/chat/completions``), :mod:`.vllm` (``/inference/v1/generate``):
  each writes its request and parses its reply, bytes straight to packed arrays, into
  :class:`Generation`; :mod:`.parse` holds the checks they share.
* :mod:`.settings`: :class:`EngineSettings` and the reply bound :func:`reply_byte_bound`.

A new engine API is one dialect module (a class with ``generate``, ``version_paths``, the abort
endpoint) and its line in :data:`~.dialects.DIALECTS`.

Weight versions come from the reply (SGLang's ``meta_info.weight_version``, vLLM's spans); when
a reply has none, from the dialect's model-info endpoints (SGLang, OpenAI: ``GET /model_info``
then ``/get_model_info``, the gateway only routes the latter; vLLM: ``GET /weight_info``), 2 s
timeout, cached for a short TTL, failures of any kind keeping the last good value (logged at
debug level, never raised). A server that has none (vLLM's OpenAI API) reports ``None`` and the
producer falls back to the trainer's version at admission. A gateway is detected by
``GET /workers``: :meth:`EngineClient.abort_all` then aborts on each worker it lists, and
:meth:`EngineClient.tokenize` falls back to a worker's ``/tokenize``.
"""

from rollstream.common.versions import parse_version

from .client import EngineClient, route_key
from .fleet import EngineState
from .settings import (
    ENGINE_APIS,
    REPLY_BASE_BYTES,
    REPLY_LOGPROB_BYTES,
    REPLY_PROMPT_TOKEN_BYTES,
    REPLY_TOKEN_BYTES,
    EngineSettings,
    reply_byte_bound,
)
from .types import EngineReplyInvalid, Generation, Messages

__all__ = [
    "ENGINE_APIS",
    "REPLY_BASE_BYTES",
    "REPLY_LOGPROB_BYTES",
    "REPLY_PROMPT_TOKEN_BYTES",
    "REPLY_TOKEN_BYTES",
    "EngineClient",
    "EngineReplyInvalid",
    "EngineSettings",
    "EngineState",
    "Generation",
    "Messages",
    "parse_version",
    "reply_byte_bound",
    "route_key",
]
