"""Stand-in for slime.utils.http_utils: the module-level client, ``init_http_client`` and ``post``
as published (retries up to ``max_retries`` with 1 s between attempts, JSON or text reply);
no Ray-distributed POST."""

import asyncio
import json
import logging

import httpx

logger = logging.getLogger(__name__)

_http_client: httpx.AsyncClient | None = None
_client_concurrency: int = 0


def get_rollout_num_engines(args) -> int:
    if (num_engines := getattr(args, "rollout_num_engines", None)) is not None:
        return int(num_engines)
    rollout_num_gpus = getattr(args, "rollout_num_gpus", None) or 0
    rollout_num_gpus_per_engine = getattr(args, "rollout_num_gpus_per_engine", None) or 1
    if rollout_num_gpus <= 0:
        return 0
    return max(1, rollout_num_gpus // rollout_num_gpus_per_engine)


def init_http_client(args):
    global _http_client, _client_concurrency
    num_engines = get_rollout_num_engines(args)
    if num_engines <= 0:
        return
    _client_concurrency = args.sglang_server_concurrency * num_engines
    if _http_client is None:
        _http_client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=_client_concurrency),
            timeout=httpx.Timeout(None),
            trust_env=False,
        )


async def _post(client, url, payload, max_retries=60, headers=None):
    retry_count = 0
    while retry_count < max_retries:
        response = None
        try:
            response = await client.post(url, json=payload or {}, headers=headers)
            response.raise_for_status()
            content = await response.aread()
            try:
                output = json.loads(content)
            except json.JSONDecodeError:
                output = content.decode() if isinstance(content, bytes) else content
        except Exception as e:
            retry_count += 1
            logger.info(f"Error: {e}, retrying... (attempt {retry_count}/{max_retries}, url={url})")
            if retry_count >= max_retries:
                raise e
            await asyncio.sleep(1)
            continue
        finally:
            if response is not None:
                await response.aclose()
        break
    return output


async def post(url, payload, max_retries=60, headers=None):
    return await _post(_http_client, url, payload, max_retries, headers=headers)


async def get(url):
    response = await _http_client.get(url)
    response.raise_for_status()
    content = await response.aread()
    return json.loads(content)
