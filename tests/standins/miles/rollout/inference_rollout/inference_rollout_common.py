"""Stand-in for miles.rollout.inference_rollout.inference_rollout_common: ``GenerateState`` as
published (tokenizer, processor, semaphore, sampling params, the generate function named by
``custom_generate_function_path``, else the stock single-turn one), ``compute_sampling_params``,
and the stock InferenceRolloutFn's eval path, async like the real one, recording calls."""

import asyncio
from argparse import Namespace
from typing import Any

from miles.rollout.base_types import RolloutFnConstructorInput, RolloutFnEvalOutput
from miles.rollout.generate_hub.single_turn import generate
from miles.rollout.inference_rollout.compatibility import load_generate_function
from miles.utils.processing_utils import load_processor, load_tokenizer


class GenerateState:
    def __init__(self, args: Namespace) -> None:
        self.args = args
        self.tokenizer = load_tokenizer(
            args.hf_checkpoint, chat_template_path=args.chat_template_path, trust_remote_code=True
        )
        self.processor = load_processor(args.hf_checkpoint, trust_remote_code=True)
        self.generate_fn_semaphore = asyncio.Semaphore(
            args.sglang_server_concurrency * args.rollout_num_gpus // args.rollout_num_gpus_per_engine
        )
        self.sampling_params: dict[str, Any] = compute_sampling_params(
            args,
            temperature=args.rollout_temperature,
            top_p=args.rollout_top_p,
            top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len,
        )
        self.generate_function = load_generate_function(args.custom_generate_function_path) or generate
        self.reset()

    def reset(self) -> None:
        self.aborted = False


def compute_sampling_params(args, *, temperature, top_p, top_k, max_new_tokens):
    return dict(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        stop=args.rollout_stop,
        stop_token_ids=args.rollout_stop_token_ids,
        skip_special_tokens=args.rollout_skip_special_tokens,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )

EVAL_CALLS = []


class InferenceRolloutFn:
    def __init__(self, input: RolloutFnConstructorInput):
        self.args = input.args
        self.data_source = input.data_source

    async def __call__(self, input):
        if not input.evaluation:
            raise NotImplementedError("the stand-in serves evaluation only")
        EVAL_CALLS.append((input.rollout_id, input.weight_version))
        data = {"standin_eval": {"rewards": [0.5], "truncated": [False], "samples": []}}
        return RolloutFnEvalOutput(data=data, metrics={"eval/standin": float(input.rollout_id)})
