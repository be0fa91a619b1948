"""Stand-in for slime's stock rollout: only its eval path, which records the calls."""

from slime.rollout.base_types import RolloutFnEvalOutput

EVAL_CALLS = []


def generate_rollout(args, rollout_id, data_source, evaluation=False):
    assert args.rollout_global_dataset
    if not evaluation:
        raise NotImplementedError("the stand-in serves evaluation only")
    EVAL_CALLS.append((rollout_id, evaluation))
    data = {"standin_eval": {"rewards": [1.0, 0.0], "truncated": [False, True], "samples": []}}
    return RolloutFnEvalOutput(data=data, metrics={"eval/standin": float(rollout_id)})
