"""A simulated inference engine: a test double for SGLang / vLLM (not a model)."""

from rollstream.testing.sim.engine import (
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
