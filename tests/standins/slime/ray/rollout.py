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
        """slime's ``_convert_samples_to_train_data`` @ 624b824 without torch (numpy stands in for
        ``torch.as_tensor``), the default reward path (no normalisation), plus the stand-in's
        own checks (tokens hold the prompt, string weight versions) and ``group_indices``."""
        return convert_samples_to_train_data(self.args, samples)


def _get_source(sample):
    metadata = getattr(sample, "metadata", None) or {}
    if getattr(sample, "source", None):
        return sample.source
    if metadata.get("source_name"):
        return metadata["source_name"]
    return "unknown"


def validate_rollout_routed_experts_for_replay(routed_experts, args):
    """slime.observability.rollout_data_utils' R3 check (shape and all-zero layers), on numpy."""
    import numpy as np

    if not routed_experts:
        raise ValueError("R3 is enabled but no rollout routed-experts tensors were returned.")
    num_layers = int(args.num_layers)
    topk = int(args.moe_router_topk)
    for sample_idx, experts in enumerate(routed_experts):
        experts = np.asarray(experts)
        if experts.ndim != 3 or tuple(experts.shape[1:]) != (num_layers, topk):
            raise ValueError(f"Invalid rollout routed-experts shape for R3: sample={sample_idx}, got={experts.shape}")
        if experts.shape[0] == 0:
            raise ValueError(f"R3 sample {sample_idx} has no routed-experts rows.")
        if topk > 1:
            missing = [layer for layer in range(num_layers) if not np.count_nonzero(experts[:, layer, :])]
            if missing:
                raise ValueError(f"R3 routed-experts capture is all zero for MoE layers {missing}")


def convert_samples_to_train_data(args, samples):
    import numpy as np

    raw_rewards = [sample.get_reward_value(args) for sample in samples]
    rewards = raw_rewards
    rollout_ids = [sample.rollout_id for sample in samples]
    existed = set(rid for rid in rollout_ids if rid is not None)
    tmp_id = 0
    for i in range(len(rollout_ids)):
        if rollout_ids[i] is None:
            while tmp_id in existed:
                tmp_id += 1
            rollout_ids[i] = tmp_id
            existed.add(tmp_id)
    train_data = {
        "tokens": [sample.tokens for sample in samples],
        "response_lengths": [sample.response_length for sample in samples],
        "rewards": rewards,
        "raw_reward": raw_rewards,
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
        if sample.remove_sample:
            sample.loss_mask = [0] * sample.response_length
        loss_masks.append(sample.loss_mask)
    train_data["loss_masks"] = loss_masks
    totals = {}
    for rid, mask in zip(rollout_ids, loss_masks, strict=True):
        totals[rid] = totals.get(rid, 0) + sum(mask)
    train_data["rollout_mask_sums"] = [totals[rid] for rid in rollout_ids]
    if any(sample.metadata and "raw_reward" in sample.metadata for sample in samples):
        train_data["raw_reward"] = [
            sample.metadata["raw_reward"] if sample.metadata and "raw_reward" in sample.metadata else sample.reward
            for sample in samples
        ]
    if samples[0].metadata and "round_number" in samples[0].metadata:
        train_data["round_number"] = [sample.metadata["round_number"] for sample in samples]
    if samples[0].rollout_log_probs is not None:
        for sample in samples:
            assert len(sample.rollout_log_probs) == sample.response_length
        train_data["rollout_log_probs"] = [sample.rollout_log_probs for sample in samples]
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        for sample in samples:
            assert sample.rollout_top_p_token_ids is not None
            assert sample.rollout_top_p_token_offsets is not None
            assert len(sample.rollout_top_p_token_offsets) == sample.response_length + 1
            assert int(sample.rollout_top_p_token_offsets[-1]) == len(sample.rollout_top_p_token_ids)
        train_data["rollout_top_p_token_ids"] = [sample.rollout_top_p_token_ids for sample in samples]
        train_data["rollout_top_p_token_offsets"] = [sample.rollout_top_p_token_offsets for sample in samples]
    if samples[0].rollout_routed_experts is not None:
        routed_experts = [np.asarray(sample.rollout_routed_experts) for sample in samples]
        if getattr(args, "use_rollout_routing_replay", False):
            validate_rollout_routed_experts_for_replay(routed_experts, args)
        train_data["rollout_routed_experts"] = routed_experts
    if samples[0].train_metadata is not None:
        train_data["metadata"] = [sample.train_metadata for sample in samples]
    if any(sample.multimodal_train_inputs is not None for sample in samples):
        train_data["multimodal_train_inputs"] = [sample.multimodal_train_inputs for sample in samples]
    if samples[0].teacher_log_probs is not None:
        train_data["teacher_log_probs"] = [sample.teacher_log_probs for sample in samples]
    if samples[0].metadata is not None:
        train_data["source_names"] = [_get_source(sample) for sample in samples]
    for sample in samples:
        assert len(sample.tokens) > sample.response_length, "tokens must hold the prompt and the response"
        assert all(isinstance(v, str) for v in sample.weight_versions)
    return train_data
