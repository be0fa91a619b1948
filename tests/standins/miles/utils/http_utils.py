"""Stand-in for miles.utils.http_utils: ``init_http_client`` and ``post`` as published (retries
up to ``max_retries``, 1 s apart, ``response.json()`` else text); no Ray-distributed POST."""

import asyncio
import json
import logging

import httpx

logger = logging.getLogger(__name__)

_http_client: httpx.AsyncClient | None = None
_client_concurrency: int = 0


def init_http_client(args):
    global _http_client, _client_concurrency
    if not args.rollout_num_gpus:
        return
    _client_concurrency = args.sglang_server_concurrency * args.rollout_num_gpus // args.rollout_num_gpus_per_engine
    if args.eval_num_gpus > 0:
        _client_concurrency += args.sglang_server_concurrency * args.eval_num_gpus // args.eval_num_gpus_per_engine
    if _http_client is None:
        _http_client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=_client_concurrency),
            timeout=httpx.Timeout(None),
        )


async def _post(client, url, payload, max_retries=60, action="post", headers=None):
    retry_count = 0
    while retry_count < max_retries:
        try:
            if action in ("delete", "get"):
                assert not payload
                response = await getattr(client, action)(url, headers=headers)
            else:
                response = await getattr(client, action)(url, json=payload or {}, headers=headers)
            response.raise_for_status()
            try:
                output = response.json()
            except json.JSONDecodeError:
                output = response.text
        except Exception as e:
            retry_count += 1
            logger.info(f"Error: {e}, retrying... (attempt {retry_count}/{max_retries}, url={url})")
            if retry_count >= max_retries:
                raise e
            await asyncio.sleep(1)
            continue
        break
    return output


async def post(url, payload, max_retries=60, action="post", headers=None):
    return await _post(_http_client, url, payload, max_retries, action=action, headers=headers)


async def get(url):
    response = await _http_client.get(url)
    response.raise_for_status()
    return response.json()
