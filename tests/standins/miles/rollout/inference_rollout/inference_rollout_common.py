"""Stand-in for miles' stock InferenceRolloutFn: its eval path, async like the real one, recording calls."""

from miles.rollout.base_types import RolloutFnConstructorInput, RolloutFnEvalOutput

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
