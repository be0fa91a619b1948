"""Samples with every field set, for tests and benchmarks (never imported by library code).

:func:`full_sample` gives the fields realistic values and fills any other declared field
(a version-3 field of :data:`~rollstream.common.models.SAMPLE_FIELDS`) with :func:`example_value`, so a
field declared in the model is set here (and round-tripped by the tests) without an edit."""

from __future__ import annotations

import random
from array import array
from typing import Any

from rollstream.common.arrays import Packed, float_array, int_array, mask_array
from rollstream.common.models import SAMPLE_FIELDS, Adapter, Group, Sample, Status
from rollstream.common.sample_fields import Kind, SampleField


def routed_experts(tokens: int, layers: int, topk: int, experts: int = 128, seed: int = 0) -> Packed:
    """A routing replay of ``(tokens - 1, layers, topk)`` ids below ``experts`` (the packed dtype
    follows from ``experts``: uint8 up to 256)."""
    rng = random.Random(seed)
    rows = max(0, tokens - 1)
    code = "B" if experts <= 256 else "H" if experts <= 65536 else "i"
    size = rows * layers * topk
    block = array(code, (rng.randrange(experts) for _ in range(min(size, 1 << 16))))
    reps, rest = divmod(size, max(1, len(block)))  # large replays repeat one random block (fast)
    data = block * reps
    data.extend(block[:rest])
    return Packed(data, (rows, layers, topk))


def full_sample(
    index: int,
    prompt_len: int = 6,
    response_len: int = 5,
    *,
    layers: int = 3,
    topk: int = 2,
    experts: int = 64,
    seed: int = 0,
) -> Sample:
    """A sample with every field of the data model set (lengths consistent with its tokens)."""
    rng = random.Random(seed * 1000 + index)
    tokens = [rng.randrange(1, 50_000) for _ in range(prompt_len + response_len)]
    n_tokens = len(tokens)
    counts = [rng.randrange(0, 4) for _ in range(response_len)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    sample = Sample(
        index=index,
        tokens=int_array(tokens),
        response="r" * response_len,
        response_length=response_len,
        reward={"score": float(index), "format": 0.5},
        status=Status.TRUNCATED if index % 2 else Status.COMPLETED,
        finish_reason="length" if index % 2 else "stop",
        weight_versions=[3, 4],
        rollout_log_probs=float_array(-0.25 * (k + 1) for k in range(response_len)),
        loss_mask=mask_array([1, 0] * (response_len // 2) + [1] * (response_len % 2)),
        metadata={"engine": "e0", "raw_reward": float(index), "round_number": 2},
        routed_experts=routed_experts(n_tokens, layers, topk, experts, seed + index),
        indexer_topk=Packed(array("H", (rng.randrange(4096) for _ in range((n_tokens - 1) * 8))), (n_tokens - 1, 2, 4)),
        top_p_token_ids=Packed(array("i", (rng.randrange(150_000) for _ in range(offsets[-1]))), (offsets[-1],)),
        top_p_token_offsets=Packed.of(offsets),
        teacher_log_probs=float_array(-0.5 * (k + 1) for k in range(response_len)),
        opd_reverse_kl=float_array(0.125 * k for k in range(response_len)),
        remove_sample=index == 1,
        train_metadata={"loss": "opd", "weight": 0.5},
        rollout_id=index // 2,
        spec_info={"spec_accept_token_num": 3, "spec_draft_token_num": 4, "spec_verify_ct": 2,
                   "completion_token_num": response_len},
        prefix_cache_info={"cached_tokens": 2, "total_prompt_tokens": prompt_len},
        non_generation_time=0.75,
        adapter=Adapter("math-lora", 1),
        multimodal_train_inputs={
            "pixel_values": Packed(array("f", [0.5] * 12), (2, 6)),
            "image_grid_thw": [[1, 2, 3]],
        },
    )
    for f in SAMPLE_FIELDS:
        if f.since >= 3 and not f.is_set(getattr(sample, f.name)):
            setattr(sample, f.name, example_value(f, n_tokens, response_len))
    return sample


def example_value(f: SampleField, tokens: int, response_length: int) -> Any:
    """A set value of field ``f`` for a sample of ``tokens`` tokens ending in ``response_length``
    response tokens (lengths as the codec checks them)."""
    if f.kind is Kind.PACKED:
        if f.length in ("rows", "rows_or_media"):
            return Packed(array("B", bytes((tokens - 1) * 2)), (tokens - 1, 1, 2))
        if f.length == "offsets":
            return Packed.of(list(range(response_length + 1)))
        return Packed.of(list(range(response_length)))
    examples = {
        Kind.FLOATS: [0.5] * response_length, Kind.MASK: [1] * response_length, Kind.MAP: {"example": 1},
        Kind.COUNTERS: {"example": 1}, Kind.FLAG: True, Kind.GROUP_ID: 0, Kind.SECONDS: 0.5,
        Kind.ADAPTER: Adapter("example", 0), Kind.MEDIA: {"example": [1]}, Kind.SPANS: [(0, response_length, 3)],
        Kind.TEXT: "example", Kind.OPT_TEXT: "example", Kind.INT: 1, Kind.VERSIONS: [3],
    }
    return examples[f.kind]


def full_group(n: int = 4, index: int = 7, **sample_kwargs: int) -> Group:
    """A group of ``n`` :func:`full_sample` s with the group-level fields set."""
    return Group(
        index=index,
        prompt=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                             {"type": "text", "text": "what is it?"}]}],
        samples=[full_sample(i, **sample_kwargs) for i in range(n)],
        label="4",
        epoch=1,
        attempt=0,
        metadata={"source_name": "vqa"},
        producer="p-0",
        multimodal_inputs={"images": ["data:image/png;base64,AA=="]},
    )
