"""``remote:URL``: a reward server, one POST per group (the protocol is in the package docstring)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
from rollstream.common.backoff import Backoff
from rollstream.common.errors import ConfigError, RewardError
from rollstream.common.models import PromptContent, Sample

from .base import RETRY_AFTER_CAP, RewardFunction, _describe, _short


class RemoteReward(RewardFunction):
    """A reward server, one POST per group (protocol in the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        attempts: int = 3,
        backoff: float = 0.5,
        max_connections: int = 64,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"remote reward URL must be http(s)://host[:port]/path, got {url!r}")
        if attempts < 1:
            raise ConfigError(f"attempts must be at least 1, got {attempts!r}")
        self.url = url
        self.name = f"remote:{url}"
        self.timeout = timeout
        self.attempts = attempts
        self.backoff = backoff
        self.max_connections = max_connections
        self._client: httpx.AsyncClient | None = None

    def _get_client(self) -> httpx.AsyncClient:
        # created lazily so that it belongs to the event loop that uses it
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0)),
                limits=httpx.Limits(
                    max_connections=self.max_connections,
                    max_keepalive_connections=min(self.max_connections, 16),
                ),
            )
        return self._client

    async def _score(
        self,
        prompt: PromptContent,
        label: Any,
        samples: list[Sample],
        metadata: Mapping[str, Any],
    ) -> list[Any]:
        body = {
            "prompt": prompt,
            "label": label,
            "responses": [sample.response for sample in samples],
            "samples": [
                {
                    "index": sample.index,
                    "status": str(sample.status),
                    "finish_reason": sample.finish_reason,
                    "response_length": sample.response_length,
                    "metadata": sample.metadata,
                }
                for sample in samples
            ],
            "metadata": dict(metadata),
        }
        try:
            content = json.dumps(body).encode()
        except (TypeError, ValueError) as exc:
            raise RewardError(f"reward request for {self.url} is not JSON-serialisable: {exc}") from exc
        reply = await self._post(content)
        if not isinstance(reply, dict) or not isinstance(reply.get("rewards"), list):
            raise RewardError(
                f"reward server {self.url} answered {_short(reply)}, expected {{'rewards': [...]}}"
            )
        rewards: list[Any] = reply["rewards"]
        if len(rewards) != len(samples):
            raise RewardError(
                f"reward server {self.url} returned {len(rewards)} rewards for {len(samples)} samples"
            )
        return rewards

    async def _post(self, content: bytes) -> Any:
        client = self._get_client()
        last_error = ""
        backoff = Backoff(base=self.backoff, cap=max(self.backoff, RETRY_AFTER_CAP))
        for attempt in range(1, self.attempts + 1):
            delay = backoff.delay(attempt - 1)
            try:
                response = await client.post(
                    self.url, content=content, headers={"Content-Type": "application/json"}
                )
            except httpx.TransportError as exc:  # connection refused/reset, timeouts
                last_error = _describe(exc)
            else:
                status = response.status_code
                if status == 429 or status >= 500:
                    last_error = f"HTTP {status}: {response.text[:200]}"
                    retry_after = _retry_after(response)
                    if retry_after is not None:
                        delay = retry_after
                elif not 200 <= status < 300:
                    raise RewardError(
                        f"reward server {self.url} rejected the request with HTTP {status}: "
                        f"{response.text[:500]}"
                    )
                else:
                    try:
                        return response.json()
                    except ValueError as exc:
                        raise RewardError(
                            f"reward server {self.url} answered with invalid JSON: "
                            f"{response.text[:200]!r}"
                        ) from exc
            if attempt < self.attempts:
                await asyncio.sleep(delay)
        raise RewardError(
            f"reward server {self.url} failed after {self.attempts} attempts: {last_error}"
        )

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_CAP) if math.isfinite(seconds) else None
