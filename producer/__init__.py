"""The producer side of rollstream: the worker process, the engine client, rewards, the feeder.

Run it with ``rollstream produce``; use :class:`Producer` to embed it in another process, or
:class:`Rollout` alone to turn prompts into scored groups without Redis.

Modules, one concern each:

* ``worker``: ``Producer``, the runtime: admission, work items (entry + admitted version), leases (renewed
  by ``producer.renewal``), the loop watchdog, control, limits; a group past ``max_attempts`` dead-lettered
  where it failed. Three of its concerns have a module each; they share its work in flight through
  ``capacity.WorkTable``'s methods and read the producer through a ``Protocol`` of its public members (none
  imports the worker back; ``tests/test_layers.py`` fails on a private member reached across modules):
* ``reclaim``: ``Reclaimer``: prompts idle past the lease taken over (one producer per interval looks for
  the fleet and announces a find), the prompts pending under its own name adopted at start, leases lost
  to another producer's reclaim; admission holds off while a reclaim is due
* ``pulse``: ``Pulse``: the heartbeat (``Pulse.assemble``, the one place a ``Heartbeat`` is built), admission's
  time blocked and the last refusal, groups in the last minute; its turn also follows the engine registry
  and the trainer's weights, and refreshes the bias gauges
* ``drain``: the end of a run: ``shutdown`` (the drain up to ``drain_timeout``, or a fatal error's record),
  ``return_unfinished`` (held prompts back to the retry stream, attempt unchanged), ``cancel_and_wait``
  (cancelled tasks get ``TASK_EXIT_TIMEOUT`` seconds, then are left behind, logged)
* ``renewal``: ``Renewer``: the leases of the prompts a producer holds, renewed every third of the lease
  from a thread with its own event loop and Redis connection, so a rollout that blocks the producer's loop
  cannot let them lapse; ``hold`` / ``release`` under a lock, ``claiming()`` around ADMIT / XAUTOCLAIM /
  adoption (then every entry pending under the name is renewed); lost leases reported back on the producer's
  loop
* ``gcpolicy``: the producer process's cyclic-GC policy: ``tune(young)`` after start-up (one collection,
  ``gc.freeze()``, a young threshold of 50,000 instead of 700), called by ``rollstream produce``
  (``--gc-threshold``, 0: Python's own); an episode's objects form no reference cycle (a trajectory holds
  its session by ``weakref.proxy``), so they are freed when it ends, not by a collection
* ``settings``: the producer's settings tree: ``ProducerSettings`` (per process) holds ``EpisodeSettings``
  (what the rollout needs: the plug-in, ``EpisodeLimits``, the failure limits), each field declared once
  with its flag, help and default (``rollstream.common.settings_fields``: ``option``, ``set_by``,
  ``branch``; validated with ``ConfigError`` in the classes' own checks); ``default_producer_name``. Plain
  dataclasses (``PipelineConfig``, ``SimConfig``) give ``init``'s, ``demo``'s and ``sim-engine``'s flags
  their help from each field's docstring (``settings_fields.documented``: what, unit, default);
  ``tests/test_cli_help.py`` fails on any option of any command without help, a default it does not say, or
  a duration without its unit
* ``capacity``: ``Capacity`` (samples in flight: taken ``n`` at a time, given back per episode), ``Work``
  (one prompt held: entry, admitted version, units) and ``WorkTable``, the one owner of the work in flight:
  the prompts held (``hold`` / ``drop`` / ``start``, leases renewed meanwhile), the capacity, ``stopping``,
  ``fail`` (the first fatal error), the Redis outage the loops ride out, and the counts (published,
  duplicates, reclaimed, returned)
* ``episode``: the rollout plug-in contract (docs/rollouts.md): ``Episode``, ``Trajectory``,
  ``EpisodeInfo``, ``SamplingParams``, ``Turn``, ``GenerateFunction``, ``EpisodeAborted``,
  ``GenerateBroken``
* ``session``: the engine session behind it, one episode: ``EpisodeSession`` (engine calls with abort
  continuation, step boundaries for a drain, and ``journaled``: every step (generate, complete, observe,
  once) replayed from the journal or run live, then recorded)
* ``trajectory``: ``SessionTrajectory``, one token sequence of an episode (tokens, mask, log-probs, versions
  and spans appended together)
* ``episode_runtime``: what all episodes of a producer share: ``EpisodeRuntime`` (engine slots held per
  request, named limits, counters, request ages, the resume wait) and ``EpisodeLimits``
* ``slots``: ``Slots``, the weighted counting semaphore of engine slots and named limits. Per-request work
  is kept out of the session: the producer's ``SamplingParams`` and its engine mapping are built once, a group's
  episode facts (metadata view, prompt ids, prompt source) once per group, a call that was one unaborted
  request takes the reply's arrays as its ``Turn``'s (no copy), and a trajectory JSON-encodes each of its
  token ids once (``engine.ids_json.IdsJson``), not again with every turn
* ``checks``: the one validation before publish: ``as_samples`` (the shape of a generate function's result)
  and ``check_sample`` (free-form fields encodable, tokens = prompt + response, mask and log-probs one per
  response token, finite where trained, spans inside the response); a problem is one FAILED sample with the
  reason
* ``rollout``: ``Rollout``: one prompt → one scored group (prompt ids, ``n`` episodes of the generate
  function under their deadline, validation, reward; ``single_turn`` the default plug-in); which failures
  are a sample's and which are fatal (``RewardBroken``, ``GenerateBroken``, ``EngineBroken``: distinct
  prompts in a row); ``aclose()`` closes the generate function; no Redis
* ``plugin``: the rollout plug-in: ``single_turn`` (the default, ``SingleTurn``) and the one ``--generate``
  loader, ``load_generate(spec, GenerateContext)``, choosing by the spec's scheme in a registry
  (``register_generate_scheme``; ``integrations.generate`` registers ``slime:`` / ``miles:`` / ``openai:``
  on import), else ``module:function`` / ``file.py:function`` through ``common.imports``
* ``outcomes``: the samples an episode ends as outside the rollout's control flow (``to_sample`` of the one
  request of ``n``, ``failed``, ``rejected``) and ``FailureLog`` (each failure reason logged once a minute,
  with a count)
* ``telemetry``: ``Metrics``: the producer's instrumentation interface, a no-op by default
* ``engine``: the engine client, transport below and one dialect module per engine API above (its docstring
  draws it). ``EngineClient`` (``client.py``): the request path, routing through the fleet, retries on
  ``common/backoff.py`` (connection errors, 5xx, 429; a request whose engine is taken out is sent again
  elsewhere); ``generate``/``generate_n``/``tokenize``/``abort_all``/``weight_version``; ``prepare()`` loads
  the tokenizer before the producer says ``running``; ``check_versions()`` asks every engine for its weight
  version once at start (OpenAI API; on the native APIs at the first reply without one) and warns, once per
  engine, naming the engines that report none and which API would (the dialect's ``version_hint``);
  ``versions_from`` (the heartbeat's ``weight_versions_from``: ``engine replies``, ``GET /weight_info``,
  ``GET /model_info``, ``trainer at admission``); the fleet calls are passed on to ``monitor.py``:
  ``FleetMonitor`` (probes of engines in trouble, loads, stalls, joining engines, the registry, gateway
  workers) and ``weights.py``: ``Versions`` (each engine's weight version, a weight update's news, the
  label of a reply without one) and ``CatchUp`` (``--catch-up-engines``). ``fleet.py``: ``Fleet`` /
  ``Engine`` / ``EngineState`` (healthy, suspect, ejected, wedged, behind, draining: docs/engines.md, the
  fleet), the consistent-hash ring with bounded loads keyed by ``route_key(index, epoch)``,
  ``apply_registry``, the client-side waits for room and for a routed engine (``wait_room``,
  ``wait_engine``); ``load.py``: each engine's load (``LoadEndpoint``, the shared ``/metrics`` parser; the
  dialects name theirs, SGLang's ``/v1/loads`` / ``/get_load`` read in ``sglang.py``) and
  ``AdaptiveLimit``, its in-flight limit (adaptive concurrency).
  ``transport.py``: the contract (bounded reads, ``too_large``, the total deadline, URL credentials as a
  header; any ``httpx`` transport for tests);
  ``http11.py``: the default, keep-alive HTTP/1.1 on ``asyncio.Protocol``, answers parsed by llhttp
  (``httptools``) (one pool per origin, at most ``max_connections`` exchanges,
  ``Content-Length``/``chunked``/until-close, TLS, a stale kept-alive connection retried once, anything
  malformed a ``ConnectionError``). ``discovery.py``: the one model-info probe (``probe_version_at``: weight
  version and the endpoint that gave it; also slime's router query) and gateway workers. Dialects:
  ``sglang.py`` (``/generate``, R3 ``decode_routed_experts``, ``parse_teacher``), ``openai.py``
  (``/v1/completions``, ``/v1/chat/completions``; versions from vLLM's ``/weight_info``, else SGLang's
  ``/model_info``), ``vllm.py`` (``/inference/v1/generate``: token ids in, weight version spans out,
  ``/weight_info`` fallback, no per-request seed unless ``request_seed``; the routing replay
  ``choices[].routed_experts``, base64 ``.npy``, read by ``vllm_replay.py``: header as a literal, dtype /
  order / shape / size / ids checked, no numpy or pickle), named in ``dialects.py``; each parses with
  msgspec typed decoders (``gc=False`` structs, shared checks in ``parse.py``) from reply bytes straight
  into packed arrays in ``Generation``, the one reply type (``types.py``); ``EngineReplyInvalid`` for an
  unusable reply. ``settings.py``: ``EngineSettings``, ``reply_byte_bound``
* ``replay``: ``with_routed_experts``: a sample's routing replay aligned with its tokens (spliced across a
  continuation), and the engine's cache / speculative counters
* ``teacher``: ``TeacherScorer``: every response scored on a teacher model (``--teacher-engine``) before the
  reward
* ``rewards``: a package, one module per kind: ``base`` (``RewardFunction``: deadline, every exception →
  ``RewardError``, result validation), ``answers`` (``math``), ``remote`` (``remote:URL``), ``python``
  (``module:function`` / ``file.py:function``, sync calls in bounded threads); ``loader``: the one
  ``load_reward(spec)``, choosing by the spec's scheme in a registry (``register_scheme``);
  ``integrations.framework_rewards`` registers ``slime:`` / ``slime-group:`` / ``miles:`` / ``miles-group:``
  when imported (the CLI imports it), so the producer never imports the integrations
* ``feeder``: ``Feeder``: the feeding loop: a dataset, or named sources ``{name: dataset}``, → prompts.
  Window, epochs, cursor; a row that cannot be fed is a dead letter (``source=feed``, reason naming file
  and row) written by the ``FEED`` script with the cursor; slime's shuffle (``shuffle_scheme="slime"``:
  ``random.seed(seed + epoch)``)
* ``feed_sources``: the sources of a feed and their mix (``SourceMix``): each source's walk through its
  epochs with its own cursor (``sources`` hash); with a mix every prompt goes to the source furthest behind
  its share of what is alive or trained (fed + requeued - lost: in flight and backlog counted), so
  generation follows the mix whatever each source's speed, and the fast source's surplus held by ``take()``
  stays bounded; a source fed to the end leaves the mix (WARNING); a reweighted mix is adopted, any other
  change stops the feed
* ``curriculum``: a curriculum from each row's history: ``RowStats`` (what ROW_STATS keeps in ``rows`` when
  the trainer commits or filters a group of the row, with ``init --row-stats K``), ``Sampler``
  (``sampler(stats, epoch, draw) -> feed now?``, the one function a user writes; ``draw`` is seeded by row
  and epoch so a restarted feeder decides the same), ``ZeroVarianceDeferral`` (``feed --curriculum
  zero-variance``): a row whose last k groups had zero reward variance is fed with probability ``offer``,
  and surely once its last group is ``max_gap`` epochs old; a deferred row is skipped for that epoch only;
  ``Deferrals``: the feeder's side (asks the sampler per row, waits when it defers whole epochs)
* ``metrics``: ``ProducerMetrics(Metrics)``: Prometheus, served from the producer's own loop (extra
  ``metrics``)
"""

from .engine import EngineClient, EngineSettings
from .episode import Episode, GenerateFunction
from .episode_runtime import EpisodeLimits
from .feeder import Feeder, FeedSettings, feed, load_jsonl
from .rewards import RewardFunction, load_reward
from .rollout import Rollout
from .settings import EpisodeSettings, ProducerSettings
from .telemetry import Metrics
from .worker import Producer

__all__ = [
    "EngineClient",
    "EngineSettings",
    "Episode",
    "EpisodeLimits",
    "EpisodeSettings",
    "FeedSettings",
    "Feeder",
    "GenerateFunction",
    "Metrics",
    "Producer",
    "ProducerSettings",
    "RewardFunction",
    "Rollout",
    "feed",
    "load_jsonl",
    "load_reward",
]
