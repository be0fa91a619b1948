"""Stand-in for miles' RolloutManager (no Ray, no engines): the class-based rollout API calls."""

import asyncio
import itertools

from miles.rollout.base_types import RolloutFnConstructorInput, RolloutFnEvalInput, RolloutFnTrainInput
from miles.rollout.inference_rollout.compatibility import call_rollout_function, load_rollout_function
from miles.utils.misc import load_function
from miles.utils.types import Sample


class RolloutManager:
    def __init__(self, args):
        self.args = args
        # set by the training actor after each weight update
        self.weight_version: int | None = None
        data_source_cls = load_function(self.args.data_source_path)
        self.data_source = data_source_cls(args)
        input = RolloutFnConstructorInput(args=args, data_source=self.data_source)
        self.generate_rollout = load_rollout_function(input, self.args.rollout_function_path)
        if self.args.eval_function_path == self.args.rollout_function_path:
            self.eval_generate_rollout = self.generate_rollout
        else:
            self.eval_generate_rollout = load_rollout_function(input, self.args.eval_function_path)

    async def generate(self, rollout_id):
        data = await asyncio.to_thread(
            call_rollout_function,
            self.generate_rollout,
            RolloutFnTrainInput(rollout_id=rollout_id, weight_version=self.weight_version),
        )
        samples = data.samples
        while isinstance(samples[0], list):
            samples = list(itertools.chain.from_iterable(samples))
        for sample in samples:
            assert sample.loss_mask is not None and len(sample.loss_mask) == sample.response_length
            assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
        return samples, data.metrics

    async def eval(self, rollout_id):
        return await asyncio.to_thread(
            call_rollout_function, self.eval_generate_rollout, RolloutFnEvalInput(rollout_id=rollout_id)
        )

    def save(self, rollout_id):
        if self.args.rollout_global_dataset:
            self.data_source.save(rollout_id)

    def load(self, rollout_id=None):
        self.data_source.load(rollout_id)
