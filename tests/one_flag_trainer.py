"""A trainer process shaped like slime's ``train.py`` / miles' ``train_async.py`` loop, over the
stand-in frameworks: ``python one_flag_trainer.py slime|miles ARGS...``.

It parses ARGS with the stand-in's argument parser (the frameworks' flag names and defaults),
builds the rollout manager (which builds rollstream's data source from ``--data-source-path``),
resumes like slime: the last checkpoint in ``--load`` (``latest_checkpointed_iteration.txt``)
gives ``start_rollout_id``, and ``load(start_rollout_id - 1)`` is called; it trains up to
``--num-rollout`` and saves every ``--save-interval`` rollouts (checkpoint file first, then the
data source's ``save``, as slime's loop does). Every trained rollout is appended (fsync'd) to
``{--save}/trained.jsonl``. With ``ONE_FLAG_HANG_AFTER=R`` it stops making progress after
training rollout R (a long training step), so a test can kill it at a known point.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "standins"))
sys.path.insert(0, str(HERE))

LATEST = "latest_checkpointed_iteration.txt"


def record(save: Path, entry: dict) -> None:
    with open(save / "trained.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def main(framework: str, argv: list[str]) -> int:
    if framework == "slime":
        from slime.ray.rollout import RolloutManager
        from slime.utils.arguments import parse_args
    else:
        from miles.ray.rollout.rollout_manager import RolloutManager
        from miles.utils.arguments import parse_args
    args = parse_args(argv)
    save = Path(args.save)
    save.mkdir(parents=True, exist_ok=True)
    loaded = -1
    if args.load and (Path(args.load) / LATEST).exists():
        loaded = int((Path(args.load) / LATEST).read_text())
    manager = RolloutManager(args)
    manager.load(loaded)
    hang_after = int(os.environ.get("ONE_FLAG_HANG_AFTER", "-1"))
    for rollout_id in range(loaded + 1, args.num_rollout):
        if framework == "slime":
            data, metrics = manager.generate(rollout_id)
            groups = sorted(set(data["group_indices"]))
        else:
            samples, metrics = asyncio.run(manager.generate(rollout_id))
            groups = sorted({s.group_index for s in samples})
        record(save, {
            "rollout": rollout_id, "groups": groups, "pid": os.getpid(),
            "replayed": metrics["rollout/rollstream/replayed"],
            "children_restarted": metrics.get("rollout/rollstream/children_restarted"),
        })
        if args.save_interval and (rollout_id + 1) % args.save_interval == 0:
            (save / LATEST).write_text(str(rollout_id))
            manager.save(rollout_id)
        if rollout_id == hang_after:
            record(save, {"hanging": rollout_id})
            while True:
                time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
