"""What an engine says about itself: its weight version (model-info endpoints) and, behind an
SGLang gateway, its workers. Best effort: failures of any kind are logged at debug level and
answered with "unknown", never raised.
"""

from __future__ import annotations

import logging

from rollstream.common.errors import EngineReplyInvalid
from rollstream.common.versions import version_of

from .http11 import Http11Transport
from .parse import json_object
from .transport import Transport

logger = logging.getLogger(__name__)

INFO_BYTES = 2**20
"""Bound of a model-info, worker-list or tokenize reply (they are a few hundred bytes)."""

PROBE_ERRORS = (ConnectionError, TimeoutError, EngineReplyInvalid)


async def probe_version(
    transport: Transport, url: str, paths: tuple[str, ...], seconds: float, *, until_valid: bool = False
) -> tuple[int | None, bool]:
    """``(version, exists)``: :func:`probe_version_at` without the path."""
    version, _, exists = await probe_version_at(transport, url, paths, seconds, until_valid=until_valid)
    return version, exists


async def probe_version_at(
    transport: Transport, url: str, paths: tuple[str, ...], seconds: float, *, until_valid: bool = False
) -> tuple[int | None, str, bool]:
    """``(version, path, exists)``: the ``weight_version`` of the first of ``paths`` that exists on
    ``url`` and the path that gave it (a 404 tries the next; ``exists`` is False when every one is
    404). A failure, another status or no integer version gives None, unless ``until_valid``:
    then the next path is tried. ``seconds`` per path, in total."""
    missing = 0
    for path in paths:
        try:
            status, raw = await transport.request("GET", url + path, limit=INFO_BYTES, seconds=seconds)
        except PROBE_ERRORS as exc:
            logger.debug("%s%s failed: %s: %s", url, path, type(exc).__name__, exc)
            if until_valid:
                continue
            return None, "", True
        if status == 404:
            missing += 1
            continue
        version = version_of(json_object(raw)) if status == 200 else None
        if version is None:
            logger.debug("%s%s: HTTP %d, no integer weight_version", url, path, status)
            if until_valid:
                continue
            return None, "", True
        return version, path, True
    return None, "", missing < len(paths)


FROM_REPLIES = "engine replies"
"""``weight_versions_from`` when the replies carry the versions (SGLang ``meta_info``, vLLM spans)."""
FROM_TRAINER = "trainer at admission"
"""``weight_versions_from`` when no engine says: the trainer's version when the prompt was admitted."""


async def engine_version(url: str, paths: tuple[str, ...], seconds: float = 2.0) -> int | None:
    """The weight version the first answering endpoint of ``paths`` reports, or None: one call,
    its own connection (slime's rollout asks its router once per rollout)."""
    transport = Http11Transport(max_connections=2, connect_timeout=seconds)
    try:
        version, _ = await probe_version(transport, url.rstrip("/"), paths, seconds, until_valid=True)
    finally:
        await transport.aclose()
    return version


async def gateway_workers(transport: Transport, url: str, seconds: float) -> tuple[bool, list[str] | None]:
    """``(answered, workers)``: the worker URLs if ``url`` is an SGLang gateway (``GET /workers``),
    None when it is not one; ``answered`` False when it could not be asked (keep what was known)."""
    try:
        status, raw = await transport.request("GET", url + "/workers", limit=INFO_BYTES, seconds=seconds)
    except PROBE_ERRORS as exc:
        logger.debug("%s/workers failed: %s: %s", url, type(exc).__name__, exc)
        return False, None
    if status != 200:
        return True, None
    reply = json_object(raw)
    if reply is None:
        logger.debug("%s/workers answered no JSON object", url)
        return False, None
    workers = reply.get("workers")
    if not isinstance(workers, list):
        return True, None
    return True, [str(w["url"]).rstrip("/") for w in workers if isinstance(w, dict) and w.get("url")]
