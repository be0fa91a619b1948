"""The engine APIs (``--engine-api``): a new API is one dialect module and one line here."""

from __future__ import annotations

from .openai import OpenAI
from .sglang import SGLang
from .types import Dialect
from .vllm import VLLM

DIALECTS: dict[str, Dialect] = {"sglang": SGLang(), "openai": OpenAI(), "vllm": VLLM()}
