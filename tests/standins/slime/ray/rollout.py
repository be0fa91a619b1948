"""Stand-in for slime's RolloutManager (no Ray, no engines): how it calls the rollout function
and the data source, and what its training path reads from the samples."""

import itertools

from slime.rollout.base_types import call_rollout_fn
from slime.utils.misc import load_function
from slime.utils.types import Sample


class RolloutManager:
    def __init__(self, args):
        self.args = args
        data_source_cls = load_function(self.args.data_source_path)
        self.data_source = data_source_cls(args)
        self.generate_rollout = load_function(self.args.rollout_function_path)
        self.eval_generate_rollout = load_function(self.args.eval_function_path)

    def generate(self, rollout_id):
        data = call_rollout_fn(self.generate_rollout, self.args, rollout_id, self.data_source, evaluation=False)
        metrics = data.metrics
        data = data.samples
        while isinstance(data[0], list):
            data = list(itertools.chain.from_iterable(data))
        return self._convert_samples_to_train_data(data), metrics

    def eval(self, rollout_id):
        return call_rollout_fn(self.eval_generate_rollout, self.args, rollout_id, self.data_source, evaluation=True)

    def save(self, rollout_id):
        self.data_source.save(rollout_id)

    def load(self, rollout_id=None):
        self.data_source.load(rollout_id)

    def _convert_samples_to_train_data(self, samples):
        raw_rewards = [sample.get_reward_value(self.args) for sample in samples]
        rollout_ids = [sample.rollout_id if sample.rollout_id is not None else sample.index for sample in samples]
        train_data = {
            "tokens": [sample.tokens for sample in samples],
            "response_lengths": [sample.response_length for sample in samples],
            "rewards": raw_rewards,
            "truncated": [1 if sample.status == Sample.Status.TRUNCATED else 0 for sample in samples],
            "sample_indices": [sample.index for sample in samples],
            "rollout_ids": rollout_ids,
            "group_indices": [sample.group_index for sample in samples],
        }
        loss_masks = []
        for sample in samples:
            if sample.loss_mask is None:
                sample.loss_mask = [1] * sample.response_length
            assert (
                len(sample.loss_mask) == sample.response_length
            ), f"loss mask length {len(sample.loss_mask)} != response length {sample.response_length}"
            loss_masks.append(sample.loss_mask)
        train_data["loss_masks"] = loss_masks
        if samples[0].rollout_log_probs is not None:
            for sample in samples:
                assert len(sample.rollout_log_probs) == sample.response_length
            train_data["rollout_log_probs"] = [sample.rollout_log_probs for sample in samples]
        for sample in samples:
            assert len(sample.tokens) > sample.response_length, "tokens must hold the prompt and the response"
            assert all(isinstance(v, str) for v in sample.weight_versions)
        return train_data
