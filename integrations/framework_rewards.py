"""Producers that reuse a slime or miles user's reward code: ``--reward slime:pkg.module.fn``.

Importing this module registers its :data:`SCHEMES` with the one reward loader
(:func:`rollstream.producer.rewards.register_scheme`), so ``load_reward("slime:...")`` builds a
:class:`FrameworkReward` (the CLI imports it before loading ``--reward``).

slime's custom reward signature is ``async def rm(args, sample) -> float | dict`` (per sample,
``--custom-rm-path``) or ``async def rm(args, samples) -> list`` (per group, ``--group-rm``).
The specs are

* ``slime:pkg.module.fn`` / ``miles:pkg.module.fn``: per sample (``pkg.module:fn`` works too);
* ``slime-group:pkg.module.fn`` / ``miles-group:...``: per group, the list of a group's samples.

Each call gets framework ``Sample`` objects converted from the producer's group (prompt, label,
tokens, response, status, metadata incl. the group's, ...), so the function runs unchanged on
the producer node; the framework must be importable there (a clear error otherwise). ``args`` is
an ``argparse.Namespace`` built from the JSON object in ``ROLLSTREAM_REWARD_ARGS`` (e.g.
``{"rm_type": "deepscaler"}``) over defaults for what slime's ``rm_hub.async_rm`` reads
(``custom_rm_path``, ``rm_type``, ``rm_url``, ``reward_key``: None). Sync functions work too.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from rollstream.common.errors import ConfigError
from rollstream.common.imports import import_callable
from rollstream.common.models import Group, PromptContent, Sample
from rollstream.producer.rewards import RewardFunction, register_scheme

from .convert import MILES, SLIME, Framework, to_framework
from .environment import args_from_env

REWARD_ARGS = "ROLLSTREAM_REWARD_ARGS"
ARG_DEFAULTS: dict[str, Any] = {"custom_rm_path": None, "rm_type": None, "rm_url": None, "reward_key": None}
"""What slime's ``rm_hub.async_rm`` reads from ``args``; ROLLSTREAM_REWARD_ARGS overrides them."""
SCHEMES: dict[str, tuple[Framework, bool]] = {
    "slime": (SLIME, False),
    "slime-group": (SLIME, True),
    "miles": (MILES, False),
    "miles-group": (MILES, True),
}


def is_framework_reward(spec: str) -> bool:
    """True for ``slime:...``, ``slime-group:...``, ``miles:...``, ``miles-group:...``."""
    scheme, sep, rest = spec.strip().partition(":")
    return bool(sep) and scheme in SCHEMES and bool(rest.strip())


def reward_args(environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    return argparse.Namespace(**{**ARG_DEFAULTS, **args_from_env(REWARD_ARGS, environ)})


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class FrameworkReward(RewardFunction):
    """A slime/miles reward function scoring rollstream groups through framework samples."""

    def __init__(
        self,
        framework: Framework,
        fn: Callable[..., Any],
        *,
        per_group: bool,
        args: argparse.Namespace,
        name: str,
        timeout: float | None = 30.0,
    ) -> None:
        self.framework = framework
        self.sample_cls = framework.sample_class()
        self.fn = fn
        self.per_group = per_group
        self.args = args
        self.name = name
        self.deadline = timeout

    async def _score(
        self,
        prompt: PromptContent,
        label: Any,
        samples: list[Sample],
        metadata: Mapping[str, Any],
    ) -> Any:
        group = Group(index=0, prompt=prompt, samples=list(samples), label=label, metadata=dict(metadata))
        converted = to_framework(group, self.sample_cls, replays=False)  # a reward needs no replay
        if self.per_group:
            return list(await _maybe_await(self.fn(self.args, converted)))
        return list(await asyncio.gather(*(_maybe_await(self.fn(self.args, s)) for s in converted)))


def load_framework_reward(spec: str, *, timeout: float = 30.0) -> FrameworkReward:
    """The reward named by ``slime:...`` (and the other :data:`SCHEMES`); ConfigError when the
    framework is not importable here or the spec is bad."""
    if not is_framework_reward(spec):
        raise ConfigError(f"reward spec {spec!r} must look like 'slime:package.module.function'")
    scheme, _, path = spec.strip().partition(":")
    framework, per_group = SCHEMES[scheme]
    try:
        framework.sample_class()
    except ConfigError as exc:
        raise ConfigError(
            f"--reward {spec}: the {framework.name} package is not importable on this producer node, "
            f"so its Sample cannot be built: install {framework.name} here (same version as the trainer) "
            f"or serve the reward over HTTP with --reward remote:URL ({exc.__cause__})"
        ) from exc
    fn = import_callable(path.strip(), "reward spec", dotted=True)
    return FrameworkReward(framework, fn, per_group=per_group, args=reward_args(), name=spec, timeout=timeout)


def _load(spec: str, timeout: float) -> RewardFunction:
    return load_framework_reward(spec, timeout=timeout)


for _scheme in SCHEMES:
    register_scheme(_scheme, _load, usage=f"{_scheme}:package.module.function")
