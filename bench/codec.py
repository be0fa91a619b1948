"""Codec: encode+decode time per group and payload bytes per token, rollstream vs msgpack lists vs json."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import msgpack
from rollstream.common.codec import decode_group, encode_group
from rollstream.common.models import Group

from bench.common import Table, make_group

N = 8


def _plain(group: Group) -> dict[str, Any]:
    """The same data with token ids and log-probs as plain lists (what a naive codec sends)."""
    return {
        "index": group.index, "prompt": group.prompt, "label": group.label, "producer": group.producer,
        "samples": [
            {
                "i": s.index, "tok": s.tokens.tolist(), "resp": s.response, "rlen": s.response_length,
                "rew": s.reward, "st": s.status.value, "fr": s.finish_reason, "wv": s.weight_versions,
                "lp": s.rollout_log_probs.tolist() if s.rollout_log_probs is not None else None,
                "md": s.metadata,
            }
            for s in group.samples
        ],
    }


def _time(fn: Callable[[], Any], budget: float) -> float:
    """Best-of-5 mean seconds per call, each round ~budget/5 s."""
    fn()
    best = float("inf")
    for _ in range(5):
        reps, started = 0, time.perf_counter()
        while True:
            fn()
            reps += 1
            elapsed = time.perf_counter() - started
            if elapsed >= budget / 5:
                break
        best = min(best, elapsed / reps)
    return best


def run(quick: bool = False) -> list[Table]:
    sizes = [1024, 8192] if quick else [1024, 8192, 32768]
    budget = 0.05 if quick else 1.0
    rows: list[list[Any]] = []
    for tokens in sizes:
        group = make_group(N, tokens)
        payload = encode_group(group)
        total_tokens = N * tokens
        as_lists = _plain(group)
        mp = msgpack.packb(as_lists, use_bin_type=True)
        js = json.dumps(as_lists).encode()
        ours = _time(lambda g=group: decode_group(encode_group(g)), budget)  # type: ignore[misc]
        t_mp = _time(lambda d=as_lists: msgpack.unpackb(msgpack.packb(d, use_bin_type=True)), budget)  # type: ignore[misc]
        t_js = _time(lambda d=as_lists: json.loads(json.dumps(d)), budget)  # type: ignore[misc]
        enc = _time(lambda g=group: encode_group(g), budget)  # type: ignore[misc]
        rows.append([
            f"8 x {tokens // 1024}k", ours * 1e6, enc * 1e6, t_mp * 1e6, t_js * 1e6,
            t_mp / ours, len(payload) / total_tokens, len(mp) / total_tokens, len(js) / total_tokens,
        ])
    return [Table(
        "codec", "Codec: encode + decode per group (8 samples, 64 prompt + R response tokens, log-probs)",
        ["group", "rollstream µs", "(encode only) µs", "msgpack lists µs", "json µs", "msgpack/rollstream",
         "rollstream B/token", "msgpack B/token", "json B/token"],
        rows,
        [
            "Same data in all three: prompt + response ids (int32 range), float32 log-probs per response token.",
            "B/token = payload bytes / response tokens; the 64 prompt ids per sample are in the numerator, "
            "so the floor is 4 (id) + 4 (log-prob) + 4 x 64/R (prompt ids).",
            "Target: <= 1000 µs per 8 x 8k group; <= 8 B/token + small overhead.",
        ],
        "python -m bench codec",
    )]
