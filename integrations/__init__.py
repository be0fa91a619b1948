"""Drop-ins for the frameworks our users train with: slime and miles.

* :mod:`rollstream.integrations.slime`: ``generate_rollout`` and ``RollstreamDataSource``;
* :mod:`rollstream.integrations.miles`: ``RollstreamRolloutFn`` and ``RollstreamDataSource``;
* :mod:`rollstream.integrations.convert`: rollstream groups <-> framework samples;
* :mod:`rollstream.integrations.framework_rewards`: ``--reward slime:pkg.module.fn`` for producers (registered with
  the one reward loader when imported), :mod:`rollstream.integrations.generate`: ``--generate slime:...``.

* :mod:`rollstream.integrations.flags` / :mod:`rollstream.integrations.pipeline`: the one-flag
  run, which starts its own Redis, feeder and producers from the framework's flags.

No framework is a dependency: their modules are imported when a function is called, never when
this package is. Configuration comes from the framework's own flags and ``ROLLSTREAM_*``
environment variables (:mod:`rollstream.integrations.environment`); see docs/integrations.md.

Modules, one concern each:

* ``generate``: ``--generate slime:`` / ``miles:`` / ``openai:`` (registered with the producer's one loader
  when imported; the CLI imports it): a generate function (the episode API) that builds the framework's
  ``Sample`` and ``args`` for an episode, calls the user's function the way slime / miles call it, and
  converts what it returns
* ``endpoints``: ``EndpointServer``: one aiohttp runner per producer, one loopback port per open episode
  (``SockSite``; the handler finds its episode by the local port). ``/generate`` (SGLang's shape) calls
  ``Episode.complete``; ``/v1/chat/completions`` (Bearer = the episode's key) records token-in/token-out on
  a trajectory (``ChatRecorder``, ``integrations/chat.py``: a conversation must extend the recorded one).
  ``aclose()`` is called by the producer on drain or exit (through the adapter's ``aclose``). A refusal is
  answered and remembered: ``Endpoint.run`` cancels the user's code and raises it (the sample fails);
  handlers still running when the episode ends are cancelled
* ``flags``: what a slime/miles run's own flags say about its pipeline: the namespace config, the feeder's
  options (slime's ``Dataset`` keys and shuffle), ``RolloutFlags`` (router, concurrency =
  ``--sglang-server-concurrency`` x engines, sampling, reward spec, tokenizer); refuses what rollstream
  cannot honour (``--custom-generate-function-path``, ``--multimodal-keys``, ...)
* ``pipeline``: ``LocalPipeline``: the one-flag run's children (embedded Redis with AOF under
  ``{--save}/rollstream``, ``rollstream feed``, ``rollstream produce``) under a ``Supervisor``; namespace
  init and the stored rollout flags; ``ROLLSTREAM_START`` for a shared Redis
"""
