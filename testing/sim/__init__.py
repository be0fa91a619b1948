"""A simulated inference engine: a test double for SGLang / vLLM (not a model).

One module per seam (issue 24): ``model`` (toy tokenizer, answers, routing replay, teacher),
``state`` (the shared scheduler and state), ``shared`` (request parsing, fault injection,
``/sim/*``), ``sglang_api``, ``openai_api`` and ``vllm_api`` (one per engine API simulated),
``simulator`` (the app, :class:`SimEngine`, :func:`serve`, and the behaviour of the whole,
documented once)."""

from rollstream.testing.sim.simulator import (
    SimConfig,
    SimEngine,
    SimState,
    create_app,
    detokenize,
    evaluate_last_expression,
    serve,
    tokenize,
)

__all__ = [
    "SimConfig",
    "SimEngine",
    "SimState",
    "create_app",
    "detokenize",
    "evaluate_last_expression",
    "serve",
    "tokenize",
]
