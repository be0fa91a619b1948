"""The engines' weight-update endpoints, declared once as data: read by the trainer's
:class:`~rollstream.weight_sync.WeightSync` (pause, reload, version, resume) and by the producer's
catch-up of an engine found behind (a dialect's ``weights.catch_up_requests``), so a reload body
is written in one place and neither reader compares engine names. :class:`Call` also declares a
dialect's abort.

It lives in common because both readers may import it and neither may import the other. A new
engine server with its own endpoints is one :class:`WeightAPI` here and its line in
:data:`WEIGHT_APIS`; a dialect names the declaration of the server it speaks to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")
"""What happens to requests in flight at the pause: end them, let them finish, freeze them."""


@dataclass(frozen=True, slots=True)
class Slot:
    """A placeholder in a declared body, filled at the call (the weights' folder or the version)."""

    name: Literal["path", "version"]


WEIGHTS_PATH = Slot("path")
VERSION = Slot("version")
"""Filled with the version as a string (both servers take ``"3"``, not ``3``)."""


@dataclass(frozen=True, slots=True)
class Call:
    """One ``POST``: its path and JSON body (None: no body at all, which is not ``{}``)."""

    path: str
    body: Mapping[str, Any] | None = None

    def filled(self, path: str, version: int) -> tuple[str, dict[str, Any] | None]:
        """The path and body with the slots replaced."""
        return self.path, None if self.body is None else _fill(self.body, path, version)


def _fill(value: object, path: str, version: int) -> Any:
    if isinstance(value, Slot):
        return path if value.name == "path" else str(version)
    if isinstance(value, Mapping):
        return {k: _fill(v, path, version) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_fill(v, path, version) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class WeightAPI:
    """How one engine server pauses, loads weights from a folder, labels them and resumes.

    A mode whose ``pause`` is None does not pause (and so does not resume); a reload reply
    ``{"success": false}`` is a failure even with HTTP 200 (SGLang answers so). Every mode of
    :data:`PAUSE_MODES` is a key of ``pause``."""

    pause: Mapping[PauseMode, Call | None]
    reload: tuple[Call, ...]
    """In order; the bodies take :data:`WEIGHTS_PATH` and :data:`VERSION`."""
    resume: Call
    version_path: str
    """``GET`` that answers the engine's ``weight_version``."""
    set_version: Call | None = None
    """Labels the current weights (None: the reload already does)."""
    reset_cache: Call | None = None
    """Empties the prefix cache after a reload that keeps it (None: the reload empties it). Sent by
    the catch-up, which does not pause; ``WeightSync``'s pause empties it already."""

    def catch_up_requests(self, path: str, version: int) -> list[tuple[str, Mapping[str, Any]]]:
        """The reload, the cache reset and the version label, in order: what loads ``path`` as
        ``version`` into an engine without pausing it (the producer's ``--catch-up-engines``). A
        reload that keeps the prefix cache would leave the prompts' KV computed with the old
        weights under the new ones (samples labelled new that match neither), so it is emptied
        before the label moves: every token labelled new is the new weights' alone."""
        calls = (*self.reload, *((self.reset_cache,) if self.reset_cache is not None else ()),
                 *((self.set_version,) if self.set_version is not None else ()))
        out: list[tuple[str, Mapping[str, Any]]] = []
        for call in calls:
            step, body = call.filled(path, version)
            out.append((step, body if body is not None else {}))
        return out


# clear_cache (vLLM's default, said explicitly): with keep it preempts the frozen requests and
# recomputes their KV with the new weights at the resume, so every token after the split is the new
# weights'; without it they run on the old KV and match neither version (docs/engines.md, "keep")
VLLM_WEIGHTS = WeightAPI(
    pause={mode: Call(f"/pause?mode={mode}&clear_cache=true") for mode in PAUSE_MODES},
    reload=(Call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": WEIGHTS_PATH}}),),
    set_version=Call("/update_weight_version", {"new_version": VERSION}),
    resume=Call("/resume"),
    version_path="/weight_info",
    # reload_weights keeps the prefix cache; the reset answers {"success": false} while requests
    # hold blocks unless reset_running_requests, which preempts them (their KV is recomputed with
    # the new weights, as the keep pause's clear_cache does)
    reset_cache=Call("/reset_prefix_cache?reset_running_requests=true"),
)
"""vLLM's dev-mode endpoints (``VLLM_SERVER_DEV_MODE=1``), also behind its OpenAI server."""

# /update_weights_from_disk flushes the radix cache itself (flush_cache, on by default) and asserts
# the flush, which succeeds only with no request queued or running: unpaused, the reload first
# takes the lock every generation holds while it runs, so it waits for them (docs/engines.md)
SGLANG_WEIGHTS = WeightAPI(
    # wait does not pause: /update_weights_from_disk itself waits for the requests in flight.
    # keep is "retract", not "in_place": retract puts the running requests back in the waiting
    # queue (kept, their KV recomputed under the new weights, as vLLM's keep with clear_cache),
    # so the reload's flush succeeds; after an in_place pause SGLang refuses any flush ("Cache
    # not flushed because there are pending requests") and its scheduler stops on the assert
    pause={
        "abort": Call("/pause_generation", {"mode": "abort"}),
        "wait": None,
        "keep": Call("/pause_generation", {"mode": "retract"}),
    },
    reload=(Call("/update_weights_from_disk", {"model_path": WEIGHTS_PATH, "weight_version": VERSION}),),
    resume=Call("/continue_generation", {}),
    version_path="/get_model_info",  # the gateway routes it, not /model_info
)

WEIGHT_APIS: dict[str, WeightAPI] = {"vllm": VLLM_WEIGHTS, "sglang": SGLANG_WEIGHTS}
"""``WeightSync(kind=...)``: the engine servers whose weights rollstream can update."""
