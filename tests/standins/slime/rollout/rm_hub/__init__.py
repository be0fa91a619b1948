"""Stand-in for slime's ``slime.rollout.rm_hub``: ``async_rm`` and ``batched_async_rm`` dispatch to
``--custom-rm-path`` as the real ones do (the real hub's built-in ``--rm-type`` verifiers are not
reproduced: the stand-in types are ``contains``, 1.0 when the response contains the label, and
``math``, rollstream's math verifier standing in for slime's)."""

from slime.utils.misc import load_function


async def async_rm(args, sample, **kwargs):
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, sample)
    if args.rm_type == "math":  # slime's math verifier; rollstream's stands in for it
        from rollstream.producer.rewards.answers import math_reward

        return math_reward(sample.response, sample.label)
    if args.rm_type == "contains":
        return float(str(sample.label) in sample.response)
    raise NotImplementedError(f"Rule-based RM for {args.rm_type} is not implemented.")


async def batched_async_rm(args, samples, **kwargs):
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return [await async_rm(args, sample) for sample in samples]
