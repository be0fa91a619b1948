"""Stand-in for slime's ``slime.utils.arguments`` (THUDM/slime @ 624b824): the flags rollstream's
one-flag run reads, with slime's names, types and defaults (``slime/utils/arguments.py`` and
``slime/backends/sglang_utils/arguments.py``; Megatron's ``--save`` / ``--load`` / ``--save-interval``
as slime resets them). ``parse_args`` ends like slime's (``eval_function_path`` defaults to the
rollout function)."""

import argparse
import json


def add_slime_rollout_arguments(parser):
    # cluster
    parser.add_argument("--rollout-num-gpus", type=int, default=None)
    parser.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    # rollout
    parser.add_argument("--hf-checkpoint", type=str, default=None)
    parser.add_argument("--rollout-function-path", type=str, default="slime.rollout.sglang_rollout.generate_rollout")
    parser.add_argument("--rollout-temperature", type=float, default=1.0)
    parser.add_argument("--rollout-top-p", type=float, default=1.0)
    parser.add_argument("--rollout-top-k", type=int, default=-1)
    parser.add_argument("--rollout-max-prompt-len", type=int, default=None)
    parser.add_argument("--rollout-max-response-len", type=int, default=None)
    parser.add_argument("--rollout-skip-special-tokens", action="store_true", default=False)
    parser.add_argument("--rollout-stop", type=str, nargs="+", default=None)
    parser.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None)
    parser.add_argument("--rollout-shuffle", action="store_true", default=False)
    parser.add_argument("--rollout-seed", type=int, default=42)
    parser.add_argument("--over-sampling-batch-size", type=int, default=None)
    parser.add_argument("--dynamic-sampling-filter-path", type=str, default=None)
    parser.add_argument("--partial-rollout", action="store_true", default=False)
    parser.add_argument("--custom-generate-function-path", type=str, default=None)
    parser.add_argument("--update-weights-interval", type=int, default=1)
    # data
    parser.add_argument("--num-rollout", type=int, default=None)
    parser.add_argument("--num-epoch", type=int, default=None)
    parser.add_argument("--disable-rollout-global-dataset", action="store_false", dest="rollout_global_dataset")
    parser.add_argument("--data-source-path", type=str, default="slime.rollout.data_source.RolloutDataSourceWithBuffer")
    parser.add_argument("--prompt-data", type=str, default=None)
    parser.add_argument("--apply-chat-template", action="store_true", default=False)
    parser.add_argument("--apply-chat-template-kwargs", type=json.loads, default="{}")
    parser.add_argument("--input-key", type=str, default="input")
    parser.add_argument("--label-key", type=str, default=None)
    parser.add_argument("--multimodal-keys", type=json.loads, default=None)
    parser.add_argument("--metadata-key", type=str, default="metadata")
    parser.add_argument("--tool-key", type=str, default="tools")
    parser.add_argument("--start-rollout-id", type=int, default=None)
    parser.add_argument("--rollout-batch-size", type=int, required=True)
    parser.add_argument("--n-samples-per-prompt", type=int, default=1)
    # eval
    parser.add_argument("--eval-function-path", type=str, default=None)
    parser.add_argument("--eval-interval", type=int, default=None)
    parser.add_argument("--eval-prompt-data", type=str, default=None, nargs="+")
    parser.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    parser.add_argument("--eval-temperature", type=float, default=None)
    parser.add_argument("--eval-top-p", type=float, default=None)
    parser.add_argument("--eval-max-response-len", type=int, default=None)
    # reward model
    parser.add_argument("--rm-type", type=str, default=None)
    parser.add_argument("--reward-key", type=str, default=None)
    parser.add_argument("--group-rm", action="store_true", default=False)
    parser.add_argument("--rm-url", type=str, default=None)
    parser.add_argument("--custom-rm-path", type=str, default=None)
    # sglang (slime/backends/sglang_utils/arguments.py)
    parser.add_argument("--sglang-router-ip", type=str, default=None)
    parser.add_argument("--sglang-router-port", type=int, default=None)
    parser.add_argument("--sglang-server-concurrency", type=int, default=512)
    # megatron, as slime resets them
    parser.add_argument("--load", type=str, default=None)
    parser.add_argument("--save", type=str, default=None)
    parser.add_argument("--save-interval", type=int, default=None)
    return parser


def parse_args(argv=None):
    parser = add_slime_rollout_arguments(argparse.ArgumentParser())
    args = parser.parse_args(argv)
    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path
    return args
