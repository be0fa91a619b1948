"""Run slime's and miles' generate functions, and OpenAI-API agents, on rollstream producers.

Importing this module registers its :data:`SCHEMES` with the one ``--generate`` loader
(:func:`rollstream.producer.plugin.load_generate`).

``rollstream produce --generate SCHEME:pkg.module.fn`` (``pkg.module:fn`` works too):

* ``slime:`` a slime custom generate function, ``async def generate(args, sample,
  sampling_params[, evaluation]) -> Sample | list[Sample]`` (what ``--custom-generate-function-path``
  names), called the way slime's ``generate_and_rm`` calls it (``evaluation=False`` when the
  signature has it);
* ``miles:`` a miles generate function, ``async def generate(input: GenerateFnInput) ->
  GenerateFnOutput``, loaded with miles' own ``load_generate_function`` (so slime's form and
  classes work through miles' adapter, as in miles);
* ``openai:`` an agent written against an OpenAI-compatible server, ``async def agent(*,
  base_url, api_key, prompt, request_kwargs, metadata, **kwargs) -> dict | None`` (miles'
  ``--custom-agent-function-path`` contract plus the key); the returned dict is merged into the
  sample's metadata.

Each episode gets its own loopback endpoint (:mod:`rollstream.integrations.endpoints`): slime's
``args.sglang_router_ip`` / ``sglang_router_port`` point at it, so the function's engine calls go
through the producer's engine session (capacity per request, deadlines, retries, aborts, weight
versions). The framework's ``Sample`` is built from the episode (``group_index``, ``index`` =
``group_index * n + member`` as slime's data source numbers them, ``prompt``, ``label``,
``metadata``, ``session_id``; ``tokens`` = the prompt ids for chat prompts) and what comes back
(one sample or a flat list) is converted to rollstream samples; the producer validates them
before publish (tokens = prompt + response, one mask entry and log-prob per response token).

``args`` is an ``argparse.Namespace`` of what slime's and miles' generate paths read (router
address, ``hf_checkpoint`` = the producer's ``--tokenizer``, the rollout sampling settings from
the producer's, ``partial_rollout=False``: the producer's session continues aborted calls itself),
overridden by the JSON object in ``ROLLSTREAM_GENERATE_ARGS`` (``{"generate_max_turns": 4}``).
The framework must be importable on the producer node (a clear ConfigError otherwise).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import math
import uuid
from array import array
from collections.abc import Callable, Mapping
from typing import Any

from rollstream.common.codec import check_lengths
from rollstream.common.errors import ConfigError, DecodeError, InvalidResult
from rollstream.common.imports import import_callable, import_object
from rollstream.common.models import Sample, Status
from rollstream.producer.checks import not_plain
from rollstream.producer.episode import Episode, GenerateFunction, GenerateResult
from rollstream.producer.plugin import GenerateContext, register_generate_scheme

from .convert import MILES, SLIME, Framework, framework_fields
from .endpoints import Endpoint, EndpointServer
from .environment import args_from_env

GENERATE_ARGS = "ROLLSTREAM_GENERATE_ARGS"
SCHEMES = ("slime", "miles", "openai")
_FRAMEWORKS = {"slime": SLIME, "miles": MILES}


def is_framework_generate(spec: str) -> bool:
    """True for ``slime:...``, ``miles:...`` and ``openai:...``."""
    scheme, sep, rest = spec.strip().partition(":")
    return bool(sep) and scheme in SCHEMES and bool(rest.strip())


def _env_args(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    return args_from_env(GENERATE_ARGS, environ)


def default_args(path: str, *, tokenizer: str | None, concurrency: int, n: int | None = None) -> dict[str, Any]:
    """What slime's and miles' generate paths read from ``args``, for a producer."""
    return {
        "sglang_router_ip": "127.0.0.1",
        "sglang_router_port": None,  # per episode
        "sglang_model_routers": None,
        "router_policy": None,
        "sglang_router_policy": None,
        "hf_checkpoint": tokenizer,
        "chat_template_path": None,
        "custom_generate_function_path": path,
        "custom_rm_path": None,
        "rm_type": None,
        "rm_url": None,
        "reward_key": None,
        "group_rm": False,
        "partial_rollout": False,
        "mask_offpolicy_in_partial_rollout": False,
        "ci_test": False,
        "use_rollout_routing_replay": False,
        "use_rollout_indexer_replay": False,
        "sglang_speculative_algorithm": None,
        "sglang_enable_deterministic_inference": False,
        "rollout_seed": 42,
        "n_samples_per_prompt": n,
        "rollout_temperature": 1.0,
        "rollout_top_p": 1.0,
        "rollout_top_k": -1,
        "rollout_max_response_len": 1024,
        "rollout_max_context_len": None,
        "rollout_stop": None,
        "rollout_stop_token_ids": None,
        "rollout_skip_special_tokens": False,
        "sglang_server_concurrency": max(1, concurrency),
        "sglang_dp_size": None,
        "rollout_num_engines": 1,
        "rollout_num_gpus": 1,
        "rollout_num_gpus_per_engine": 1,
        "eval_num_gpus": 0,
        "eval_num_gpus_per_engine": 1,
        "use_distributed_post": False,
        "save_debug_trajectory_data": None,
    }


def _sampling_dict(episode: Episode) -> dict[str, Any]:
    """The ``sampling_params`` slime's GenerateState would hand the function, from the producer's."""
    sampling = episode.sampling
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": -1,
        "max_new_tokens": sampling.max_new_tokens,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        **dict(sampling.extra),
    }


# -- conversion -------------------------------------------------------------------------------


def framework_sample(framework: Framework, episode: Episode) -> Any:
    """The framework ``Sample`` a data source would hand the generate function for this episode."""
    cls = framework.sample_class()
    info = episode.info
    sample = cls(
        group_index=info.index,
        index=info.index * info.n + info.member,
        prompt=copy.deepcopy(info.prompt),
        label=info.label,
        metadata=copy.deepcopy(dict(info.metadata)),
    )
    if not isinstance(info.prompt, str) and info.prompt_ids is not None:
        sample.tokens = list(info.prompt_ids)  # a chat prompt: its rendered ids, as slime reuses sample.tokens
    if hasattr(sample, "session_id"):
        sample.session_id = str(uuid.uuid4())
    return sample


def plain_metadata(metadata: Any, what: str) -> dict[str, Any]:
    """``metadata`` if it is plain data the wire format can carry; InvalidResult (the sample fails)
    otherwise, rather than an unencodable group that would stop the producer at publish."""
    if not isinstance(metadata, Mapping):
        raise InvalidResult(f"{what} is a {type(metadata).__name__}, not a dict")
    if (problem := not_plain(metadata, what)) is not None:
        raise InvalidResult(problem)
    return dict(metadata)


def _versions(values: Any) -> list[int]:
    out = []
    for value in values or ():
        try:
            out.append(int(str(value).strip()))
        except ValueError:
            continue
    return out


def from_framework_sample(
    fw: Any, member: int, endpoint: Endpoint | None, episode: Episode, *, only: bool = True
) -> Sample:
    """A rollstream sample of a framework sample the function returned; InvalidResult when its shape is wrong.

    The fields every framework sample has are read here (tokens and lengths, status and finish
    reason, weight versions, loss mask, reward); the declared ones (``SampleField.framework``:
    replays, teacher log-probs, spec info, ...) by :func:`~.convert.framework_fields`, one rule
    per kind, so none is dropped; lengths are checked as the trainer's decoder checks them."""
    if isinstance(fw, list | tuple):
        raise InvalidResult(
            f"returned a nested list ({type(fw).__name__} inside the list): give a Sample or a flat list"
        )
    for name in ("tokens", "response_length", "status"):
        if not hasattr(fw, name):
            raise InvalidResult(f"returned a {type(fw).__name__}, not a framework Sample (no {name!r})")
    info = episode.info
    tokens = array("i", [int(t) for t in fw.tokens])
    response_length = int(fw.response_length)
    if not 0 <= response_length <= len(tokens):
        raise InvalidResult(f"response_length {response_length} does not fit the {len(tokens)} tokens")
    raw_status = getattr(fw.status, "value", fw.status)
    metadata = plain_metadata(fw.metadata or {}, "the returned sample's metadata")
    error = None
    if raw_status == "pending":  # the function never set it: a response means it finished
        if response_length == 0:
            raise InvalidResult("returned a PENDING sample without a response (nothing was generated)")
        raw_status = "completed"
    try:
        status = Status(raw_status)
    except ValueError:
        raise InvalidResult(f"returned a sample with status {raw_status!r}") from None
    if status == Status.FAILED:
        error = str(metadata.get("error") or "the generate function returned a FAILED sample")[:1000]
    finish = {Status.COMPLETED: "stop", Status.TRUNCATED: "length", Status.ABORTED: "abort"}.get(status)
    versions = _versions(fw.weight_versions)
    if (only or not versions) and endpoint is not None and endpoint.versions:
        # one sample holds every call of the episode: the versions of every engine call as the
        # endpoint saw them (a call continued after an abort counts each version, where the
        # function's meta_info says one)
        versions = list(endpoint.versions)
    if not versions:
        versions = [info.admitted_version]
    mask = None if fw.loss_mask is None else array("B", [int(m) for m in fw.loss_mask])
    if mask is None:
        mask = array("B", b"\x01" * response_length)
    log_probs = None
    if fw.rollout_log_probs is not None:
        log_probs = array("f", [float(v) for v in fw.rollout_log_probs])
    reward = fw.reward
    if reward is not None and not isinstance(reward, dict):
        reward = float(reward)
        if not math.isfinite(reward):
            raise InvalidResult(f"returned a non-finite reward {reward!r}")
    try:
        declared = framework_fields(fw, info.index * info.n)
    except ValueError as exc:
        raise InvalidResult(f"the returned sample's {exc}") from None
    sample = Sample(
        index=member,
        tokens=tokens,
        response=fw.response or "",
        response_length=response_length,
        prompt_length=len(tokens) - response_length,
        reward=reward,
        status=status,
        finish_reason=finish,
        weight_versions=versions,
        rollout_log_probs=log_probs,
        loss_mask=mask,
        metadata=metadata,
        error=error,
        **declared,
    )
    try:
        check_lengths(sample, "the returned sample")
    except DecodeError as exc:
        raise InvalidResult(exc.detail) from None
    return sample


def to_samples(result: Any, endpoint: Endpoint | None, episode: Episode) -> GenerateResult:
    """What the framework function returned (a Sample or a flat list), as rollstream samples."""
    items = list(result) if isinstance(result, list | tuple) else [result]
    if not items:
        raise InvalidResult("returned an empty list: an episode yields at least one sample")
    only = len(items) == 1
    samples = [from_framework_sample(fw, episode.member, endpoint, episode, only=only) for fw in items]
    return samples[0] if not isinstance(result, list | tuple) else samples


# -- the adapters ----------------------------------------------------------------------------


class _Adapter:
    """Shared by the schemes: the endpoint server, args, and how the user's code is called."""

    def __init__(self, spec: str, fn: Any, args: dict[str, Any], server: EndpointServer | None) -> None:
        self.spec = spec
        self.fn = fn
        self.base_args = args
        self.env_keys = set(_env_args())
        self.server = server if server is not None else EndpointServer()
        self.__name__ = spec  # the producer names the function in its errors
        self._clients_ready = False

    async def aclose(self) -> None:
        """Close the endpoint server (the producer calls it on drain or exit, episodes ended)."""
        await self.server.aclose()

    def init_clients(self, args: argparse.Namespace) -> None:
        """Create slime's / miles' module-level HTTP client (``http_utils.init_http_client``), as
        their rollout managers do before the first generate call: a function of either form may
        call either ``post``."""
        if self._clients_ready:
            return
        for module_name in ("slime.utils.http_utils", "miles.utils.http_utils"):
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            if getattr(module, "_http_client", None) is None and hasattr(module, "init_http_client"):
                module.init_http_client(args)
        self._clients_ready = True

    def args_for(self, episode: Episode, endpoint: Endpoint) -> argparse.Namespace:
        """This episode's ``args``: the rollout settings are the producer's unless
        ROLLSTREAM_GENERATE_ARGS set them; the router is the episode's endpoint."""
        values = dict(self.base_args)
        sampling = episode.sampling
        for name, value in (
            ("rollout_temperature", sampling.temperature),
            ("rollout_top_p", sampling.top_p),
            ("rollout_max_response_len", sampling.max_new_tokens),
        ):
            if name not in self.env_keys:
                values[name] = value
        values["n_samples_per_prompt"] = episode.n
        values["sglang_router_port"] = endpoint.port
        values["sglang_router_ip"] = self.server.public_host
        return argparse.Namespace(**values)


class SlimeGenerate(_Adapter):
    """``--generate slime:...``: a slime custom generate function on a producer."""

    framework = SLIME

    def __init__(
        self, spec: str, fn: Callable[..., Any], args: dict[str, Any], server: EndpointServer | None = None
    ) -> None:
        super().__init__(spec, fn, args, server)
        self.has_evaluation = "evaluation" in inspect.signature(fn).parameters

    async def __call__(self, episode: Episode) -> GenerateResult:
        sample = framework_sample(SLIME, episode)
        async with self.server.open(episode, sglang=True) as endpoint:
            args = self.args_for(episode, endpoint)
            self.init_clients(args)
            params = _sampling_dict(episode)
            if self.has_evaluation:
                result = await endpoint.run(self.fn(args, sample, params, evaluation=False))
            else:
                result = await endpoint.run(self.fn(args, sample, params))
            return to_samples(result, endpoint, episode)


class MilesGenerate(_Adapter):
    """``--generate miles:...``: a miles generate function (or slime's form, through miles' adapter)."""

    framework = MILES

    def __init__(self, spec: str, fn: Any, args: dict[str, Any], server: EndpointServer | None = None) -> None:
        super().__init__(spec, fn, args, server)
        self._state: Any = None

    def _state_for(self, args: argparse.Namespace) -> Any:
        """miles' GenerateState, built once per producer (it loads the tokenizer); each episode
        gets a shallow copy whose ``args`` name its own endpoint."""
        if self._state is None:
            from miles.rollout.inference_rollout.inference_rollout_common import (
                GenerateState,
            )

            self.init_clients(args)
            self._state = GenerateState(args)
        state = copy.copy(self._state)
        state.args = args
        return state

    async def __call__(self, episode: Episode) -> GenerateResult:
        from miles.rollout.base_types import GenerateFnInput, GenerateFnOutput

        sample = framework_sample(MILES, episode)
        async with self.server.open(episode, sglang=True) as endpoint:
            args = self.args_for(episode, endpoint)
            state = self._state_for(args)
            params = {**copy.deepcopy(getattr(state, "sampling_params", None) or {}), **_sampling_dict(episode)}
            work = self.fn(GenerateFnInput(state=state, sample=sample, sampling_params=params, evaluation=False))
            output = await endpoint.run(work)
            if not isinstance(output, GenerateFnOutput):
                raise InvalidResult(f"returned a {type(output).__name__}, not a GenerateFnOutput")
            return to_samples(output.samples, endpoint, episode)


class OpenAIAgent(_Adapter):
    """``--generate openai:...``: an agent loop against the episode's OpenAI-compatible endpoint."""

    async def __call__(self, episode: Episode) -> GenerateResult:
        async with self.server.open(episode, chat=True) as endpoint:
            request_kwargs = {
                "max_tokens": episode.sampling.max_new_tokens,
                "temperature": episode.sampling.temperature,
                "top_p": episode.sampling.top_p,
            }
            extra = await endpoint.run(
                _maybe_await(
                    self.fn(
                        base_url=endpoint.base_url,
                        api_key=endpoint.api_key,
                        prompt=copy.deepcopy(episode.prompt),
                        request_kwargs=request_kwargs,
                        metadata=copy.deepcopy(dict(episode.metadata)),
                    )
                )
            )
            if extra is not None and not isinstance(extra, Mapping):
                raise InvalidResult(f"the agent returned a {type(extra).__name__}; return a dict of metadata or None")
            trajectory = endpoint.recorder.trajectory
            if trajectory is None:
                raise InvalidResult("the agent made no chat completion request: nothing to train on")
            sample = trajectory.sample
            if extra:
                sample.metadata.update(plain_metadata(extra, "the agent's returned metadata"))
            return sample


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def load_framework_generate(
    spec: str,
    *,
    tokenizer: str | None = None,
    concurrency: int = 256,
    server: EndpointServer | None = None,
) -> GenerateFunction:
    """The generate function named by ``slime:`` / ``miles:`` / ``openai:`` ``pkg.module.fn``.

    ``tokenizer`` is the producer's ``--tokenizer`` (slime's and miles' ``GenerateState`` load
    theirs from ``args.hf_checkpoint``); ``concurrency`` sizes their HTTP client's pool."""
    if not is_framework_generate(spec):
        raise ConfigError(f"--generate {spec!r} must look like 'slime:package.module.function' (or miles:, openai:)")
    scheme, _, path = spec.strip().partition(":")
    path = path.strip()
    args = {**default_args(path, tokenizer=tokenizer, concurrency=concurrency), **_env_args()}
    framework = _FRAMEWORKS.get(scheme)
    if framework is not None:
        try:
            framework.sample_class()
        except ConfigError as exc:
            raise ConfigError(
                f"--generate {spec}: the {framework.name} package is not importable on this producer node "
                f"({exc.__cause__}); install it here (the trainer's version)"
            ) from exc
    if scheme == "miles":
        from miles.rollout.inference_rollout.compatibility import (
            load_generate_function,
        )

        import_object(path, "--generate", dotted=True)  # a clear ConfigError for a bad path before miles' loader
        fn = load_generate_function(path.replace(":", "."))
        if not callable(fn):
            raise ConfigError(f"--generate {spec}: {path!r} is not callable")
        return MilesGenerate(spec, fn, args, server)
    fn = import_callable(path, "--generate", dotted=True)
    if scheme == "slime":
        if not inspect.iscoroutinefunction(fn):
            raise ConfigError(
                f"--generate {spec}: a slime generate function is 'async def generate(args, sample, sampling_params)'"
            )
        return SlimeGenerate(spec, fn, args, server)
    return OpenAIAgent(spec, fn, args, server)


def _load(spec: str, context: GenerateContext) -> GenerateFunction:
    return load_framework_generate(
        spec,
        tokenizer=context.tokenizer,
        concurrency=context.concurrency,
        server=EndpointServer(host=context.endpoint_host),
    )


for _scheme in SCHEMES:
    register_generate_scheme(_scheme, _load)
