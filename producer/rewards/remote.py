"""``remote:URL``: a reward server, one POST per group (the protocol is in the package docstring)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from rollstream.common.backoff import Backoff
from rollstream.common.errors import ConfigError, RewardError
from rollstream.common.models import PromptContent, Sample

from .base import RETRY_AFTER_CAP, RewardFunction, _describe, _short

if TYPE_CHECKING:
    import aiohttp


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
        self._client: aiohttp.ClientSession | None = None

    def _get_client(self) -> aiohttp.ClientSession:
        # created lazily so that it belongs to the event loop that uses it (and aiohttp is
        # imported only by a producer that uses a remote reward: it is a tenth of a CLI start's CPU)
        if self._client is None:
            import aiohttp

            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=min(self.timeout, 10.0)),
                cookie_jar=aiohttp.DummyCookieJar(),
                raise_for_status=False,
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
        import aiohttp

        client = self._get_client()
        last_error = ""
        backoff = Backoff(base=self.backoff, cap=max(self.backoff, RETRY_AFTER_CAP))
        for attempt in range(1, self.attempts + 1):
            delay = backoff.delay(attempt - 1)
            try:
                async with client.post(
                    self.url, data=content, headers={"Content-Type": "application/json"}, allow_redirects=False
                ) as response:
                    status = response.status
                    raw = await response.read()
                    retry_after = _retry_after(response.headers.get("Retry-After"))
            except (aiohttp.ClientError, TimeoutError) as exc:  # connection refused/reset, timeouts
                last_error = _describe(exc)
            else:
                text = raw.decode("utf-8", "replace")
                if status == 429 or status >= 500:
                    last_error = f"HTTP {status}: {text[:200]}"
                    if retry_after is not None:
                        delay = retry_after
                elif not 200 <= status < 300:
                    raise RewardError(
                        f"reward server {self.url} rejected the request with HTTP {status}: {text[:500]}"
                    )
                else:
                    try:
                        return json.loads(raw)
                    except ValueError as exc:
                        raise RewardError(
                            f"reward server {self.url} answered with invalid JSON: {text[:200]!r}"
                        ) from exc
            if attempt < self.attempts:
                await asyncio.sleep(delay)
        raise RewardError(
            f"reward server {self.url} failed after {self.attempts} attempts: {last_error}"
        )

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_CAP) if math.isfinite(seconds) else None
