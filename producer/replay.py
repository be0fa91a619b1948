"""Engine-side training arrays of a sample: the routing replay (R3) kept aligned with its tokens.

SGLang's replay covers the request's whole sequence (input + output tokens - 1 rows), or, when it
says ``routed_experts_start_len``, the rows after that many. A continued sample (partial rollout)
sent ``prefix.tokens`` as its input, so a full replay already covers the prefix; a partial one is
spliced onto the prefix's own rows. Either way the result has exactly ``len(tokens) - 1`` rows,
row ``i`` being the routing of token ``i``, or the sample fails (FAILED, group recycled) with the
reason: a misaligned replay must never reach the trainer.
"""

from __future__ import annotations

from dataclasses import replace

from rollstream.common.models import Sample, Status

from .engine import Generation


def with_routed_experts(sample: Sample, generation: Generation, prefix: Sample | None) -> Sample:
    """``sample`` with the routing replay of ``generation`` (spliced onto ``prefix``'s rows
    when the engine skipped them), or the sample FAILED when the rows do not line up; and with
    the engine's prefix-cache and speculative-decoding counters, added to the prefix's."""
    _add_counters(sample, generation, prefix)
    experts = generation.routed_experts
    if experts is None:
        return sample
    start = generation.routed_experts_start
    if start:
        base = prefix.routed_experts if prefix is not None else None
        if base is None or len(base) < start:
            held = 0 if base is None else len(base)
            return _misaligned(sample, f"routed_experts_start_len {start} but the continued sample holds {held} rows")
        experts = base.rows(start).concat(experts)
    if sample.prompt_length == 0 and sample.status != Status.ABORTED:
        return _misaligned(sample, "a routing replay needs the prompt token ids (--tokenizer, or tokenised prompts)")
    if len(experts) != len(sample.tokens) - 1:
        if sample.status == Status.ABORTED:  # recycled anyway: the next attempt asks again
            return sample
        return _misaligned(sample, f"{len(experts)} rows for {len(sample.tokens)} tokens (expected tokens - 1)")
    sample.routed_experts = experts
    return sample


def _add_counters(sample: Sample, generation: Generation, prefix: Sample | None) -> None:
    """slime's and miles' ``PrefixCacheInfo`` / ``SpecInfo`` from SGLang's ``meta_info``, summed
    over the engine calls of a continued sample (the frameworks' ``add``)."""
    got = generation.counters
    if not got:
        return
    cache = dict(prefix.prefix_cache_info or {}) if prefix is not None else {}
    if "cached_tokens" in got or "prompt_tokens" in got:
        cache["cached_tokens"] = cache.get("cached_tokens", 0) + got.get("cached_tokens", 0)
        cache["total_prompt_tokens"] = cache.get("total_prompt_tokens", 0) + got.get("prompt_tokens", 0)
        sample.prefix_cache_info = cache
    if "spec_draft_token_num" in got or "spec_verify_ct" in got:
        spec = dict(prefix.spec_info or {}) if prefix is not None else {}
        for ours, theirs in (("spec_accept_token_num", "spec_accept_token_num"),
                             ("spec_draft_token_num", "spec_draft_token_num"), ("spec_verify_ct", "spec_verify_ct"),
                             ("completion_token_num", "completion_tokens")):
            spec[ours] = spec.get(ours, 0) + got.get(theirs, 0)
        sample.spec_info = spec


def _misaligned(sample: Sample, detail: str) -> Sample:
    return replace(
        sample, status=Status.FAILED, finish_reason="invalid_reply",
        error=f"invalid engine reply: routed_experts: {detail}",
    )
