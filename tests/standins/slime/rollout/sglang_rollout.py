"""Stand-in for slime.rollout.sglang_rollout: ``GenerateState`` (the singleton a custom generate
function reads the tokenizer from), the stock single-turn ``generate`` (text-only path: no
multimodal inputs, routing replay or tracing), and the stock eval path, which records its calls:
with ``--eval-prompt-data`` it generates and scores every eval prompt while the caller waits (as
``eval_rollout`` does, one dataset after another, text-only), else it returns fixed data."""

import asyncio
import json
from argparse import Namespace
from typing import Any

import httpx

from slime.rollout.base_types import RolloutFnEvalOutput
from slime.utils.http_utils import get_rollout_num_engines, post
from slime.utils.misc import SingletonMeta
from slime.utils.processing_utils import load_processor, load_tokenizer
from slime.utils.types import Sample

EVAL_CALLS = []


class GenerateState(metaclass=SingletonMeta):
    """The global state for the generation process."""

    def __init__(self, args: Namespace) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        self.processor = load_processor(args.hf_checkpoint, trust_remote_code=True)
        self.semaphore = asyncio.Semaphore(args.sglang_server_concurrency * get_rollout_num_engines(args))
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature,
            top_p=args.rollout_top_p,
            top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len,
            stop=args.rollout_stop,
            stop_token_ids=args.rollout_stop_token_ids,
            skip_special_tokens=args.rollout_skip_special_tokens,
            no_stop_trim=True,
            spaces_between_special_tokens=False,
        )
        self.reset()

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings = set()
        self.aborted = False


def _prepare_prompt_ids(sample: Sample, tokenizer, processor: Any) -> list[int]:
    if sample.tokens:
        return sample.tokens
    return tokenizer.encode(sample.prompt, add_special_tokens=False)


async def generate(args: Namespace, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Generate using traditional SGLang router with token-based workflow"""
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"

    assert (
        sample.status == Sample.Status.PENDING or sample.status == Sample.Status.ABORTED
    ), f"Sample status is {sample.status}"

    prompt_ids = _prepare_prompt_ids(sample, state.tokenizer, state.processor)

    sampling_params["max_new_tokens"] -= sample.response_length
    assert sampling_params["max_new_tokens"] >= 0
    if sampling_params["max_new_tokens"] == 0:
        sample.status = Sample.Status.TRUNCATED
        return sample

    payload = {"sampling_params": sampling_params, "return_logprob": True, "input_ids": prompt_ids}
    if not sample.tokens:
        sample.tokens = prompt_ids

    output = await post(url, payload)

    if "output_token_logprobs" in output["meta_info"]:
        new_response_tokens = [item[1] for item in output["meta_info"]["output_token_logprobs"]]
        new_response_log_probs = [item[0] for item in output["meta_info"]["output_token_logprobs"]]
    else:
        new_response_tokens, new_response_log_probs = [], []

    sample.append_response_tokens(
        args,
        tokens=new_response_tokens,
        log_probs=new_response_log_probs,
        trainable=True,
        meta_info=output["meta_info"],
        text=output["text"],
    )
    return sample


async def eval_rollout_single_dataset(args, rollout_id, name, rows):
    """slime's stock eval of one dataset, text-only: every prompt ``n_samples_per_eval_prompt`` times
    on the router with the eval sampling, scored by ``rm_hub.async_rm``, the trainer waiting."""
    from slime.rollout.rm_hub import async_rm

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    params = dict(
        temperature=args.eval_temperature if args.eval_temperature is not None else args.rollout_temperature,
        top_p=args.eval_top_p if args.eval_top_p is not None else args.rollout_top_p,
        max_new_tokens=args.eval_max_response_len or args.rollout_max_response_len,
    )
    data = []
    for i, row in enumerate(rows):
        for j in range(args.n_samples_per_eval_prompt):
            sample = Sample(index=i * args.n_samples_per_eval_prompt + j, prompt=row[args.input_key],
                            label=row.get(args.label_key) if args.label_key else None)
            async with httpx.AsyncClient(timeout=60) as client:
                reply = (await client.post(url, json={"text": sample.prompt, "sampling_params": dict(params)})).json()
            sample.response = reply["text"]
            finish = reply["meta_info"]["finish_reason"]["type"]
            sample.status = Sample.Status.TRUNCATED if finish == "length" else Sample.Status.COMPLETED
            sample.reward = await async_rm(args, sample)
            data.append(sample)
    return {name: {"rewards": [s.reward for s in data], "truncated": [s.status == Sample.Status.TRUNCATED
                                                                        for s in data], "samples": data}}


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    assert args.rollout_global_dataset
    if not evaluation:
        raise NotImplementedError("the stand-in serves evaluation only")
    EVAL_CALLS.append((rollout_id, evaluation))
    if getattr(args, "eval_prompt_data", None):
        values = list(args.eval_prompt_data)
        data = {}
        for i in range(0, len(values), 2):
            with open(values[i + 1], encoding="utf-8") as handle:
                rows = [json.loads(line) for line in handle if line.strip()]
            data |= asyncio.run(eval_rollout_single_dataset(args, rollout_id, values[i], rows))
        return RolloutFnEvalOutput(data=data)
    data = {"standin_eval": {"rewards": [1.0, 0.0], "truncated": [False, True], "samples": []}}
    return RolloutFnEvalOutput(data=data, metrics={"eval/standin": float(rollout_id)})
