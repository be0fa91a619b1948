"""The inference-engine client: transport below, one dialect module per engine API above.

* :mod:`.transport`: the HTTP contract (bounded reads, the total deadline, URL credentials; any
  ``httpx`` transport for tests); :mod:`.http11`: the default, keep-alive HTTP/1.1 on
  ``asyncio.Protocol`` with its connection pool.
* :mod:`.client`: :class:`EngineClient`, the request path (send, retries on
  :class:`~rollstream.common.backoff.Backoff`, sent again elsewhere, blame; generate, tokenize)
  and what the producer calls (passed on to the monitor and the versions); :mod:`.fleet`: the
  engines' states and the moves between them; :mod:`.engine_state`: one engine's record;
  :mod:`.routing`: the cache-aware routing with bounded loads; :mod:`.monitor`:
  :class:`~.monitor.FleetMonitor`, the fleet monitor (health probes, loads, stalls, joining
  engines, the registry, gateway workers, ``abort_all``); :mod:`.weights`: each engine's weight
  version (shared cached reads, a weight update's news, the label of a reply without one) and the
  catch-up of engines left behind; :mod:`.discovery`: model-info versions and gateway workers. A
  request learns that its engine was taken out through its own await (the engine's ``lost``
  future, awaited beside its HTTP call); neither the fleet nor its monitor cancels a task it does
  not own. :mod:`.ids_json`: request bodies' encoder, which writes a trajectory's token ids as
  JSON once (:class:`~.ids_json.IdsJson`).
* dialects (:mod:`.dialects` names them): :mod:`.sglang` (native ``/generate``), :mod:`.openai`
  (``/v1/completions``, ``/v1/chat/completions``), :mod:`.vllm` (``/inference/v1/generate``):
  each only translates (pure ``encode(request, settings) -> Encoded`` and ``decode(encoded,
  bytes, settings, where) -> [Generation]``, bytes straight to packed arrays; they import nothing
  of the client), and declares what differs per API (token ids or text, a model name, versions
  in replies, the routing replay, a seed that kills the engine) and every endpoint it answers
  beside generation (model-info versions and the hint said when an engine has none, load
  endpoints with their parsers, the abort, the weight-update :class:`~rollstream.common.weight_apis.WeightAPI`):
  the client reads them from the dialect (and hands them to :mod:`.discovery` and :mod:`.load`),
  never from a table keyed by API or path; :mod:`.parse` holds the checks they share; :mod:`.load`: each
  engine's own load (the shared Prometheus parser) and its adaptive in-flight limit.
* :mod:`.settings`: :class:`EngineSettings` and the reply bound :func:`reply_byte_bound`.

A new engine API is one dialect module (a class with ``encode``, ``decode`` and the attributes of
:class:`~.types.Dialect`) and its line in :data:`~.dialects.DIALECTS`: the CLI's ``--engine-api``
choices and the settings' per-API checks come from it.

Weight versions come from the reply (SGLang's ``meta_info.weight_version``, vLLM's spans); when
a reply has none, from the dialect's model-info endpoints (SGLang, OpenAI: ``GET /model_info``
then ``/get_model_info``, the gateway only routes the latter; vLLM: ``GET /weight_info``), 2 s
timeout, cached for a short TTL, failures of any kind keeping the last good value (logged at
debug level, never raised). A server that has none (vLLM's OpenAI API) reports ``None`` and the
producer falls back to the trainer's version at admission. A gateway is detected by
``GET /workers``: :meth:`EngineClient.abort_all` then aborts on each worker it lists, and
:meth:`EngineClient.tokenize` falls back to a worker's ``/tokenize``.
"""

from rollstream.common.errors import EngineReplyInvalid
from rollstream.common.versions import parse_version

from .client import EngineClient, route_key
from .engine_state import EngineState
from .settings import (
    ENGINE_APIS,
    REPLY_BASE_BYTES,
    REPLY_LOGPROB_BYTES,
    REPLY_PROMPT_TOKEN_BYTES,
    REPLY_TOKEN_BYTES,
    EngineSettings,
    reply_byte_bound,
)
from .types import Generation, Messages

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
