"""Test and demo doubles: the engine simulator (:mod:`.sim`), samples with every field set
(:mod:`.samples`), the tiny real model and its learning arithmetic (:mod:`.tiny_model`,
:mod:`.learning`) and a real vLLM launcher (:mod:`.vllm_server`). Used by the tests, the
benchmarks and the CLI's ``sim-engine`` and ``demo``; library code never imports it
(``tests/test_layers.py``), so a trainer install does not need it. The embedded Redis and the
supervisor live in ``rollstream.runtime``.

Modules, one concern each:

* ``sim``: the engine simulator, a test double for SGLang and vLLM (OpenAI API and the RL endpoints:
  ``/inference/v1/generate`` with spans and R3, ``/pause``, ``/collective_rpc reload_weights``,
  ``/update_weight_version``, ``/weight_info``); multi-turn: ``[tools=K]`` prompts get K scripted
  ``<tool>calc: EXPR</tool>`` calls; a prefix cache (``prefix_cache_tokens``, SGLang's
  ``meta_info.cached_tokens``, prefill cost per uncached token), a wedge mode (``/sim/faults {"wedge":
  true}``: accepts, never answers) and ``/sim/restart`` (version 0, cache emptied) for the fleet's checks.
  One module per seam: ``model`` (tokenizer, answers, routing replay, teacher), ``state`` (the shared
  scheduler), ``shared`` (parsing, ``sampling_params``, fault injection, ``/sim/*``), ``sglang_api``,
  ``openai_api`` (completions and chat share one parse-generate-answer path; vLLM's ``n``/``max_tokens`` and
  chat log-probs serve ``vllm_api`` too), ``vllm_api``; ``simulator`` assembles the app
* ``tiny_model``: a real tiny model built locally (byte-level BPE from ``tokenizers``, 2-layer fp32 Llama,
  ~430k parameters; ``build_moe_model``: a 2-layer Qwen3-MoE, 8 experts, top-2, for R3), the addition task
  and its exact reward; needs ``torch``, ``transformers``, ``tokenizers`` (extra ``tiny``, or
  ``.venv-vllm``)
* ``learning``: the arithmetic of the learning-speed measurement, apart from the model: ``resolve_schedule``
  (``--schedule sync|one-off|async`` to max_staleness and partial rollout; contradictory flags are a
  ``ConfigError``), ``importance_weights`` (the off-policy correction from the behaviour log-probs: TIS, MIS
  or none; the ratio in float64, so staleness 0 gives 1), ``ratio_stats`` (mean, p1, p99, max |r - 1| per
  staleness level), ``Bound`` (sync G + T against async max(G, T)); used by examples/tiny_grpo.py and
  bench/learning.py
* ``vllm_server``: start / stop a real vLLM (CPU) on a model folder, with the flags of docs/engines.md
* ``samples``: samples with every field set, and routing replays of any size (tests, benchmarks)
"""
