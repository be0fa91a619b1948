"""What a slime or miles run's own flags say about its rollstream pipeline.

A run that names rollstream's rollout function and data source already says everything the
pipeline needs: its sizes (``--rollout-batch-size``, ``--n-samples-per-prompt``,
``--max-weight-staleness``, ``--update-weights-interval``), its dataset and keys
(``--prompt-data``, ``--input-key``, ``--label-key``, ...), its engines (``--sglang-router-ip/port``,
``--sglang-server-concurrency``), its sampling flags and its reward. :func:`plan_run` reads them
once, so nothing is copied by hand into ``rollstream init`` / ``feed`` / ``produce``:

* the namespace config (:class:`~rollstream.common.config.PipelineConfig`);
* the feeder's command line (the prompts slime's ``Dataset`` would have built, in its order);
* :class:`RolloutFlags`, stored in Redis (``Keys.rollout_flags``) so that ``rollstream produce
  --redis URL --ns NS --engine URL`` on any node runs with the run's settings.

Everything a run sets that rollstream cannot honour is a ``ConfigError`` here, at start.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_SERVER_CONCURRENCY = 512
"""slime's and miles' ``--sglang-server-concurrency`` default."""
RM_HUB = {"slime": "slime.rollout.rm_hub", "miles": "miles.rollout.rm_hub"}
"""The frameworks' reward hubs: ``async_rm`` (per sample) and ``batched_async_rm`` (``--group-rm``)."""


@dataclass(frozen=True, slots=True)
class RolloutFlags:
    """The producer side of a run: what ``rollstream produce`` would otherwise be told by hand.

    Stored as a plain hash (``HGETALL rollstream:{ns}:rollout``); a field that is absent means
    "not set by the run" and ``produce`` uses its own default."""

    framework: str
    engine: str | None = None
    """The run's router, ``http://{--sglang-router-ip}:{--sglang-router-port}``."""
    concurrency: int | None = None
    """Samples in flight: ``--sglang-server-concurrency`` x engines, what slime's semaphore allows."""
    reward: str | None = None
    """A ``--reward`` spec (``slime:pkg.mod.fn``, ``slime-group:...``, ``miles:...``)."""
    reward_args: str | None = None
    """JSON object given to a ``slime:`` / ``miles:`` reward as ``args`` (ROLLSTREAM_REWARD_ARGS)."""
    tokenizer: str | None = None
    """``--hf-checkpoint``: the producer renders chat templates and tokenizes with it."""
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    """The rest of slime's sampling parameters (top_k, stop, stop_token_ids, ...), sent as they are."""
    generate: str | None = None
    """``slime:`` / ``miles:`` + the run's ``--custom-generate-function-path``: the producers'
    ``--generate``, which runs the framework's function unchanged (issue 19's adapters)."""

    def to_fields(self) -> dict[str, str]:
        out: dict[str, str] = {"framework": self.framework}
        for name in ("engine", "reward", "reward_args", "tokenizer", "generate"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        for name in ("concurrency", "max_new_tokens", "temperature", "top_p"):
            value = getattr(self, name)
            if value is not None:
                out[name] = repr(value)
        if self.sampling_params:
            out["sampling_params"] = json.dumps(self.sampling_params, sort_keys=True)
        return out

    @classmethod
    def from_fields(cls, raw: Mapping[str, str]) -> RolloutFlags:
        """Parse the stored hash; a malformed field is a ConfigError naming it."""

        def number(name: str, kind: type) -> Any:
            value = raw.get(name)
            if value is None or value == "":
                return None
            try:
                parsed = kind(value)
            except ValueError:
                raise ConfigError(f"stored rollout flag {name}={value!r} is not a valid {kind.__name__}") from None
            if kind is float and not math.isfinite(parsed):
                raise ConfigError(f"stored rollout flag {name}={value!r} is not finite")
            return parsed

        params: dict[str, Any] = {}
        if raw.get("sampling_params"):
            try:
                params = json.loads(raw["sampling_params"])
            except ValueError:
                params = None  # type: ignore[assignment]
            if not isinstance(params, dict):
                raise ConfigError("stored rollout flag sampling_params is not a JSON object")
        return cls(
            framework=raw.get("framework") or "unknown",
            engine=raw.get("engine") or None,
            concurrency=number("concurrency", int),
            reward=raw.get("reward") or None,
            reward_args=raw.get("reward_args") or None,
            tokenizer=raw.get("tokenizer") or None,
            max_new_tokens=number("max_new_tokens", int),
            temperature=number("temperature", float),
            top_p=number("top_p", float),
            sampling_params=params,
            generate=raw.get("generate") or None,
        )


@dataclass(frozen=True, slots=True)
class RunPlan:
    """The pipeline of one run, derived from its flags."""

    framework: str
    config: PipelineConfig
    flags: RolloutFlags
    feed_args: list[str]
    """``rollstream feed`` arguments after the dataset (without --redis / --ns)."""
    dataset: str
    data_dir: Path | None
    """``{--save}/rollstream``: the embedded Redis' data (None: no --save, nothing kept)."""

    @property
    def feed_datasets(self) -> list[str]:
        """``rollstream feed``'s dataset arguments: ``--prompt-data`` itself, or with a mix
        (``ROLLSTREAM_MIX``) its ``NAME=PATH,...`` sources, one argument each."""
        return named_prompt_data(self.dataset, self.config) or [self.dataset]


def _get(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def engine_count(args: Any) -> int:
    """Engines behind the router, as slime's ``get_rollout_num_engines`` counts them (at least 1:
    with external engines slime counts 0, and a producer needs some concurrency)."""
    explicit = getattr(args, "rollout_num_engines", None)
    if explicit is not None:
        return max(1, int(explicit))
    gpus = int(_get(args, "rollout_num_gpus", 0))
    per_engine = int(_get(args, "rollout_num_gpus_per_engine", 1)) or 1
    return max(1, gpus // per_engine) if gpus > 0 else 1


def reward_spec(args: Any, framework: str) -> tuple[str, dict[str, Any]]:
    """(``--reward`` spec, reward args) for the run's ``--custom-rm-path`` / ``--rm-type`` / ``--group-rm``."""
    group = bool(getattr(args, "group_rm", False))
    scheme = f"{framework}-group" if group else framework
    reward_args = {
        name: getattr(args, name)
        for name in ("rm_type", "rm_url", "reward_key", "custom_rm_path")
        if getattr(args, name, None) is not None
    }
    custom = getattr(args, "custom_rm_path", None)
    if custom and not group:
        return f"{scheme}:{custom}", reward_args
    if custom or getattr(args, "rm_type", None):
        hub = RM_HUB[framework]
        return f"{scheme}:{hub}.{'batched_async_rm' if group else 'async_rm'}", reward_args
    raise ConfigError(
        f"{framework} run without --custom-rm-path or --rm-type: rollstream's producers score the samples "
        f"with the run's reward, so name one (as {framework}'s own rollout would need)"
    )


def rollout_flags(args: Any, framework: str, engine: str | None) -> RolloutFlags:
    path = getattr(args, "custom_generate_function_path", None)
    # The producers run the function unchanged through the framework's adapter (--generate slime:/miles:).
    generate = f"{framework}:{path}" if path else None
    reward, reward_args = reward_spec(args, framework)
    concurrency = int(_get(args, "sglang_server_concurrency", DEFAULT_SERVER_CONCURRENCY)) * engine_count(args)
    if concurrency < 1:
        raise ConfigError(f"--sglang-server-concurrency must be positive, got {args.sglang_server_concurrency!r}")
    params: dict[str, Any] = {}
    top_k = getattr(args, "rollout_top_k", None)
    if top_k is not None and top_k != -1:
        params["top_k"] = int(top_k)
    for name, key in (("rollout_stop", "stop"), ("rollout_stop_token_ids", "stop_token_ids")):
        value = getattr(args, name, None)
        if value:
            params[key] = list(value)
    if getattr(args, "rollout_skip_special_tokens", False):
        params["skip_special_tokens"] = True
    if params:
        params.update({"no_stop_trim": True, "spaces_between_special_tokens": False})  # as slime sends them
    max_new = getattr(args, "rollout_max_response_len", None)
    return RolloutFlags(
        framework=framework,
        engine=engine,
        concurrency=concurrency,
        reward=reward,
        reward_args=json.dumps(reward_args, sort_keys=True) if reward_args else None,
        tokenizer=getattr(args, "hf_checkpoint", None) or None,
        max_new_tokens=int(max_new) if max_new else None,
        temperature=float(_get(args, "rollout_temperature", 1.0)),
        top_p=float(_get(args, "rollout_top_p", 1.0)),
        sampling_params=params,
        generate=generate,
    )


MIX_ENV = "ROLLSTREAM_MIX"
"""``NAME=WEIGHT,...``: the run's namespace mixes named sources (slime and miles have no flag for it);
``--prompt-data`` then names them, ``NAME=PATH,NAME=PATH``."""


def named_prompt_data(prompt_data: str, config: PipelineConfig) -> list[str]:
    """With a mix, ``--prompt-data``'s ``NAME=PATH`` sources (each a ``rollstream feed`` argument);
    ConfigError when they are not the mix's sources. Empty without a mix."""
    weights = config.weights
    if not weights:
        return []
    sources = [part.strip() for part in prompt_data.split(",") if part.strip()]
    names = [part.partition("=")[0] for part in sources]
    if any("=" not in part for part in sources) or sorted(names) != sorted(weights):
        raise ConfigError(
            f"{MIX_ENV}={config.mix!r} mixes named sources: --prompt-data must name each once, "
            f"{','.join(f'{name}=PATH' for name in weights)} (got {prompt_data!r})"
        )
    return sources


PARTIAL_ROLLOUT = "ROLLSTREAM_PARTIAL_ROLLOUT"


def partial_rollout(args: Any, environ: Mapping[str, str] | None = None) -> bool:
    """rollstream's partial rollout for the run: on (its default) unless ``ROLLSTREAM_PARTIAL_ROLLOUT=0``;
    the framework's ``--partial-rollout`` asks for it too (its parser's default, False, cannot say off)."""
    value = (os.environ if environ is None else environ).get(PARTIAL_ROLLOUT, "").strip().lower()
    if value not in ("", "0", "1", "false", "true", "off", "on"):
        raise ConfigError(f"environment variable {PARTIAL_ROLLOUT}={value!r}: expected 1 or 0")
    return bool(getattr(args, "partial_rollout", False)) or value not in ("0", "false", "off")


def pipeline_config(args: Any) -> PipelineConfig:
    """The namespace config the run's sizes imply (and ``ROLLSTREAM_MIX``, the sources' mix)."""
    batch = int(args.rollout_batch_size)
    return PipelineConfig(
        n_samples_per_prompt=int(_get(args, "n_samples_per_prompt", 1)),
        batch_size=batch,
        max_staleness=getattr(args, "max_weight_staleness", None),
        max_backlog=2 * batch,
        partial_rollout=partial_rollout(args),
        steps_per_version=max(1, int(_get(args, "update_weights_interval", 1))),
        mix=os.environ.get(MIX_ENV, ""),
    )


def feed_args(args: Any, config: PipelineConfig, concurrency: int) -> tuple[str, list[str]]:
    """(dataset, ``rollstream feed`` options): slime's ``Dataset`` over ``--prompt-data``."""
    dataset = getattr(args, "prompt_data", None)
    if not dataset:
        raise ConfigError(
            "--prompt-data is not set: rollstream feeds the prompts the run's data source would have read from it"
        )
    if getattr(args, "multimodal_keys", None):
        raise ConfigError(
            "--multimodal-keys: rollstream's feeder does not map dataset keys to image placeholders; put the "
            "images in the --input-key chat messages as image parts (they reach the engines as image_data) and "
            "drop the flag"
        )
    if getattr(args, "apply_chat_template_kwargs", None):
        raise ConfigError(
            "--apply-chat-template-kwargs: the producers' tokenizer renders the chat template without extra "
            "arguments; drop the flag or bake them into the tokenizer's template"
        )
    if getattr(args, "apply_chat_template", False) and not getattr(args, "hf_checkpoint", None):
        raise ConfigError("--apply-chat-template needs --hf-checkpoint: producers render the template with it")
    if getattr(args, "rollout_max_prompt_len", None):
        logger.warning("--rollout-max-prompt-len is not applied by rollstream's feeder: long prompts are fed too")
    window = max(256, 2 * math.ceil(concurrency / config.n_samples_per_prompt))
    out = [
        "--forever",
        "--prompt-key", str(_get(args, "input_key", "input")),
        "--label-key", str(getattr(args, "label_key", None) or ""),
        "--metadata-key", str(_get(args, "metadata_key", "metadata")),
        "--window", str(window),
    ]
    if getattr(args, "tool_key", None):
        out += ["--tool-key", str(args.tool_key)]
    if getattr(args, "apply_chat_template", False):
        out.append("--as-chat")
    if getattr(args, "rollout_shuffle", False):
        out += ["--shuffle", "--shuffle-scheme", "slime", "--seed", str(_get(args, "rollout_seed", 42))]
    return str(dataset), out


def router_url(args: Any) -> str | None:
    ip, port = getattr(args, "sglang_router_ip", None), getattr(args, "sglang_router_port", None)
    return f"http://{ip}:{port}" if ip and port else None


def require_engine(args: Any, engine: str | None) -> str:
    """The producers' engine URL, now that the framework has started its router."""
    url = engine or router_url(args)
    if url is None:
        raise ConfigError(
            "--sglang-router-ip and --sglang-router-port are not known: the producers send their requests to "
            "the run's router (or set ROLLSTREAM_ENGINE_URL)"
        )
    return url


def plan_run(args: Any, framework: str, *, engine: str | None = None) -> RunPlan:
    """Everything the run's flags say about its pipeline; ConfigError for what cannot be honoured.
    ``flags.engine`` stays None while the router is unknown (miles builds the data source before
    it starts the router): :func:`require_engine` resolves it when the producers start."""
    if not getattr(args, "rollout_global_dataset", True):
        raise ConfigError(
            "--disable-rollout-global-dataset: rollstream ties commits to the data source's save(), which "
            f"{framework} calls only with its global dataset on; drop the flag"
        )
    if not getattr(args, "prompt_data", None):
        raise ConfigError(
            "--prompt-data is not set: rollstream feeds the prompts the run's data source would have read from it"
        )
    engine = engine or router_url(args)  # None: miles starts its router after the data source
    config = pipeline_config(args)
    flags = rollout_flags(args, framework, engine)
    dataset, feed = feed_args(args, config, flags.concurrency or 1)
    named_prompt_data(dataset, config)  # a mix's sources checked now, not by the feeder process
    save = getattr(args, "save", None)
    load = getattr(args, "load", None)
    data_dir = Path(save) / "rollstream" if save else None
    if load and save and Path(load).resolve() != Path(save).resolve() and (Path(load) / "rollstream").is_dir():
        logger.warning(
            "--load %s differs from --save %s: the pipeline (streams and journal) lives under --save, so this "
            "run does not see %s/rollstream", load, save, load,
        )
    return RunPlan(framework=framework, config=config, flags=flags, feed_args=feed, dataset=dataset, data_dir=data_dir)
