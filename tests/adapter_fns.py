"""Generate functions written the way slime's and miles' users write them, and OpenAI-API agents,
for ``--generate slime:`` / ``miles:`` / ``openai:`` (imported by producer processes: PYTHONPATH
holds tests/ and tests/standins/). Nothing here knows rollstream.

Every multi-turn function appends the observation ``OBS.format(turn)`` after each model turn but
the last, so a test can find those tokens (the simulator's tokens are bytes) and check that the
loss mask is 0 exactly on them."""

from __future__ import annotations

from typing import Any

TURNS = 3
OBS = "\n<obs>tool result {}</obs>\n"
"""What a tool returned after model turn ``k`` (0-based), appended as non-trainable tokens."""


# -- slime's form ---------------------------------------------------------------------------------


async def slime_tool_loop(args, sample, sampling_params):
    """A search-r1-style slime function: POST the token ids to the router, append the model's
    tokens with their log-probs and meta_info, the tool's with trainable=False."""
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.http_utils import post
    from slime.utils.types import Sample

    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sample.tokens = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    for turn in range(TURNS):
        payload = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
        output = await post(url, payload)
        if output["meta_info"]["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        items = output["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(
            args,
            tokens=[item[1] for item in items],
            log_probs=[item[0] for item in items],
            trainable=True,
            meta_info=output["meta_info"],
            text=output["text"],
        )
        if turn == TURNS - 1:
            break
        observation = OBS.format(turn)
        ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        sample.append_response_tokens(args, tokens=ids, trainable=False, text=observation)
    sample.metadata["turns"] = TURNS
    return sample


async def slime_with_evaluation(args, sample, sampling_params, evaluation=False):
    """slime passes ``evaluation`` when the signature has it; record what came."""
    from slime.rollout.sglang_rollout import generate

    sample.metadata["evaluation_seen"] = evaluation
    return await generate(args, sample, sampling_params)


async def slime_two_segments(args, sample, sampling_params):
    """Returns a list of two samples (two agents of one episode), each with its own engine call."""
    import copy

    from slime.rollout.sglang_rollout import generate

    first = await generate(args, copy.deepcopy(sample), dict(sampling_params))
    second = await generate(args, copy.deepcopy(sample), dict(sampling_params))
    first.metadata["agent"] = "a"
    second.metadata["agent"] = "b"
    return [first, second]


async def slime_nested(args, sample, sampling_params):
    """A garbage shape: a list inside the list."""
    return [[sample]]


async def slime_unencodable_metadata(args, sample, sampling_params):
    """Leaves an object in the metadata that no wire format carries."""
    from slime.rollout.sglang_rollout import generate

    sample = await generate(args, sample, sampling_params)
    sample.metadata["handle"] = object()
    return sample


# -- miles' form ----------------------------------------------------------------------------------


async def miles_tool_loop(input):
    """A miles generate function in the style of generate_hub/multi_turn.py (tool output appended
    as update_sample_with_tool_responses does)."""
    from miles.rollout.base_types import GenerateFnOutput
    from miles.rollout.generate_utils.generate_endpoint_utils import (
        compute_prompt_ids_from_sample,
        compute_request_payload,
        update_sample_from_response,
    )
    from miles.utils.http_utils import post

    args = input.args
    sample = input.sample
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sample.tokens = compute_prompt_ids_from_sample(input.state, sample)
    for turn in range(TURNS):
        payload, halt_status = compute_request_payload(args, sample.tokens, input.sampling_params)
        if payload is None:
            sample.status = halt_status
            break
        output = await post(url, payload)
        await update_sample_from_response(args, sample, payload=payload, output=output, update_loss_mask=True)
        if output["meta_info"]["finish_reason"]["type"] in ("abort", "length") or turn == TURNS - 1:
            break
        observation = OBS.format(turn)
        ids = input.state.tokenizer.encode(observation, add_special_tokens=False)
        sample.response += observation
        sample.response_length += len(ids)
        sample.tokens += ids
        sample.loss_mask += [0] * len(ids)
        sample.rollout_log_probs += [0.0] * len(ids)
    sample.metadata["turns"] = TURNS
    return GenerateFnOutput(samples=sample)


async def miles_legacy_loop(args, sample, sampling_params):
    """slime's (legacy) form written against miles' modules: run through miles' LegacyGenerateFnAdapter."""
    from miles.rollout.generate_utils.generate_endpoint_utils import (
        compute_request_payload,
        update_sample_from_response,
    )
    from miles.rollout.inference_rollout.inference_rollout_common import GenerateState  # noqa: F401 (as users import it)
    from miles.utils.http_utils import post

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sample.tokens = list(sample.prompt.encode()) if isinstance(sample.prompt, str) else sample.tokens
    payload, _ = compute_request_payload(args, sample.tokens, sampling_params)
    output = await post(url, payload)
    await update_sample_from_response(args, sample, payload=payload, output=output, update_loss_mask=True)
    sample.metadata["legacy"] = True
    return sample


# -- OpenAI-API agents (miles' custom agent contract, plus the key) --------------------------------


def _client(base_url: str, api_key: str):
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)


def _messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


async def openai_tool_agent(*, base_url, api_key, prompt, request_kwargs, metadata, **kwargs):
    """A plain agent loop on the OpenAI SDK: ask, run a 'tool', send its result back, ask again."""
    client = _client(base_url, api_key)
    messages = _messages(prompt)
    replies = []
    async with client:
        for turn in range(TURNS):
            reply = await client.chat.completions.create(model="policy", messages=messages, **request_kwargs)
            message = reply.choices[0].message
            replies.append(message.content)
            messages.append(message.model_dump(exclude_none=False))  # as SDK users echo it back
            if turn == TURNS - 1:
                break
            messages.append({"role": "tool", "tool_call_id": f"call-{turn}", "content": f"tool result {turn}"})
    return {"agent_turns": TURNS, "replies": replies}


async def openai_wrong_key_agent(*, base_url, api_key, prompt, request_kwargs, metadata, **kwargs):
    """Tries another key first (refused: 401), then works with its own."""
    import openai

    status = None
    async with _client(base_url, "rs-not-this-episodes-key") as wrong:
        try:
            await wrong.chat.completions.create(model="policy", messages=_messages(prompt), **request_kwargs)
        except openai.AuthenticationError as exc:
            status = exc.status_code
    async with _client(base_url, api_key) as client:
        await client.chat.completions.create(model="policy", messages=_messages(prompt), **request_kwargs)
    return {"wrong_key_status": status}


async def openai_rewriting_agent(*, base_url, api_key, prompt, request_kwargs, metadata, **kwargs):
    """Rewrites the model's first answer before asking again: the conversation does not extend
    the recorded one, so the producer refuses it (the agent swallows the error: it still fails)."""
    import openai

    async with _client(base_url, api_key) as client:
        messages = _messages(prompt)
        reply = await client.chat.completions.create(model="policy", messages=messages, **request_kwargs)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content + " (edited)"})
        messages.append({"role": "user", "content": "again"})
        try:
            await client.chat.completions.create(model="policy", messages=messages, **request_kwargs)
        except openai.BadRequestError:
            pass
    return None
