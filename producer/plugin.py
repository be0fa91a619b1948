"""The rollout plug-in: the default generate function, and the one ``--generate`` loader.

``load_generate(spec)`` picks by the spec's scheme in a registry, like the reward loader: a
registered ``scheme:rest`` is built by its loader (``slime:``, ``miles:`` and ``openai:`` are
registered by :mod:`rollstream.integrations.generate` when it is imported, as the CLI does: the
producer layer never imports the integrations), anything else is a Python function
(``module.path:function`` or ``path/to/file.py:function``,
:func:`rollstream.common.imports.import_callable`). A new scheme is one
:func:`register_generate_scheme` call next to its adapter; a new default rollout is a
:data:`GenerateFunction` like :class:`SingleTurn`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from rollstream.common.errors import ConfigError
from rollstream.common.imports import import_callable
from rollstream.common.models import Sample

from .episode import Episode, GenerateFunction


class SingleTurn:
    """The default rollout: one engine call per sample (today's single-turn rollout, as a plug-in).

    ``continues_partial``: with partial rollout on, its trajectory starts from this member's
    ABORTED sample of the earlier attempt, and a COMPLETED or TRUNCATED one is kept as it is."""

    continues_partial = True

    async def __call__(self, episode: Episode) -> Sample:
        await episode.generate(max_new_tokens=episode.sampling.max_new_tokens - episode.response_length)
        return episode.sample


single_turn = SingleTurn()
"""The default generate function (``rollstream produce`` without ``--generate``)."""


@dataclass(frozen=True, slots=True)
class GenerateContext:
    """What a scheme's loader may need of the producer the function will run on."""

    tokenizer: str | None = None
    """The producer's ``--tokenizer`` (name or path); slime's and miles' states load theirs from it."""
    concurrency: int = 256
    """The producer's ``--concurrency`` (sizes the frameworks' HTTP pools)."""
    endpoint_host: str = "127.0.0.1"
    """Where per-episode endpoints listen (``--endpoint-host``)."""


GenerateLoader = Callable[[str, GenerateContext], GenerateFunction]
"""``loader(spec, context)``: the generate function named by the whole (stripped) spec; ConfigError
for a bad one."""

_SCHEMES: dict[str, GenerateLoader] = {}


def register_generate_scheme(name: str, load: GenerateLoader) -> None:
    """Make ``name:...`` a ``--generate`` spec that ``load`` builds (it shadows a module of that name)."""
    if not name or not name.replace("-", "_").isidentifier():
        raise ConfigError(f"generate scheme name {name!r} must be a word (letters, digits, '-', '_')")
    _SCHEMES[name] = load


def generate_schemes() -> tuple[str, ...]:
    """The registered scheme names."""
    return tuple(_SCHEMES)


def load_generate(spec: str, context: GenerateContext | None = None) -> GenerateFunction:
    """The generate function named by ``spec`` (``--generate``, module docstring); ConfigError otherwise."""
    name, sep, _ = spec.strip().partition(":")
    load = _SCHEMES.get(name.strip()) if sep else None
    if load is not None:
        return load(spec.strip(), context if context is not None else GenerateContext())
    fn = import_callable(spec, "--generate")
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)):
        raise ConfigError(f"--generate {spec!r} must be an async function: async def generate(episode) -> Sample")
    return cast(GenerateFunction, fn)
