"""The one-flag run: a slime- or miles-shaped run that names rollstream's rollout function and data
source starts its own pipeline (embedded Redis, namespace, feeder, producers), supervised; its
flags are stored for producers on other nodes. Real processes, real Redis, the simulator."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import ProcessPool, make_namespace, wait_until
from integration_helpers import STANDINS
from redis.asyncio import Redis
from rollstream.cli.main import build_parser
from rollstream.cli.produce import produce_options
from rollstream.common.codec import decode_group_entry, decode_prompt_entry
from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys, StateField
from rollstream.common.protocol import RolloutFlagsHash
from rollstream.integrations.flags import RolloutFlags, plan_run, require_engine
from rollstream.integrations.journal import Journal
from rollstream.integrations.pipeline import components
from rollstream.producer.feeder import Feeder, FeedSettings, load_jsonl
from rollstream.runtime.children import ChildSpec, Supervisor
from rollstream.runtime.redis_server import EmbeddedRedis

TRAINER = Path(__file__).parent / "one_flag_trainer.py"


def slime_parse(argv: list[str]) -> Any:
    from slime.utils.arguments import parse_args

    return parse_args(argv)


def miles_parse(argv: list[str]) -> Any:
    from miles.utils.arguments import parse_args

    return parse_args(argv)


ROLLSTREAM_FLAGS = [
    "--rollout-function-path", "rollstream.integrations.slime.generate_rollout",
    "--data-source-path", "rollstream.integrations.slime.RollstreamDataSource",
]


def _dataset(path: Path, count: int) -> Path:
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(count):
            handle.write(json.dumps({"input": f"what is {i}?", "label": str(i), "metadata": {"row": i}}) + "\n")
    return path


# -- what the flags say -----------------------------------------------------------------------


def test_plan_reads_the_runs_own_flags(tmp_path: Path) -> None:
    args = slime_parse([
        *ROLLSTREAM_FLAGS, "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
        "--update-weights-interval", "2", "--prompt-data", "/data/x.jsonl", "--label-key", "answer",
        "--rollout-shuffle", "--rollout-seed", "7", "--apply-chat-template", "--hf-checkpoint", "/models/q",
        "--sglang-router-ip", "10.0.0.5", "--sglang-router-port", "31000", "--rollout-num-gpus", "8",
        "--rollout-num-gpus-per-engine", "2", "--rollout-temperature", "0.8", "--rollout-top-p", "0.9",
        "--rollout-top-k", "20", "--rollout-max-response-len", "4096", "--rollout-stop", "</answer>",
        "--rm-type", "deepscaler", "--save", str(tmp_path / "ckpt"),
    ])
    plan = plan_run(args, "slime")
    assert (plan.config.n_samples_per_prompt, plan.config.batch_size, plan.config.steps_per_version) == (8, 32, 2)
    assert plan.config.max_staleness is None and plan.config.max_backlog == 64
    flags = plan.flags
    assert flags.engine == "http://10.0.0.5:31000"
    assert flags.concurrency == 512 * 4  # --sglang-server-concurrency x (8 GPUs / 2 per engine)
    assert flags.reward == "slime:slime.rollout.rm_hub.async_rm"
    assert json.loads(flags.reward_args or "") == {"rm_type": "deepscaler"}
    assert (flags.tokenizer, flags.max_new_tokens, flags.temperature, flags.top_p) == ("/models/q", 4096, 0.8, 0.9)
    assert flags.sampling_params == {
        "top_k": 20, "stop": ["</answer>"], "no_stop_trim": True, "spaces_between_special_tokens": False,
    }
    assert plan.dataset == "/data/x.jsonl" and plan.data_dir == tmp_path / "ckpt" / "rollstream"
    feed = plan.feed_args
    assert feed[feed.index("--prompt-key") + 1] == "input" and feed[feed.index("--label-key") + 1] == "answer"
    assert feed[feed.index("--metadata-key") + 1] == "metadata" and feed[feed.index("--tool-key") + 1] == "tools"
    assert "--as-chat" in feed and "--forever" in feed
    assert feed[feed.index("--shuffle-scheme") + 1] == "slime" and feed[feed.index("--seed") + 1] == "7"
    assert RolloutFlags.from_fields(flags.to_fields()) == flags

    miles = miles_parse([
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--max-weight-staleness", "1",
        "--prompt-data", "x.jsonl", "--sglang-router-ip", "h", "--sglang-router-port", "1",
        "--custom-rm-path", "user_rm.group_rm", "--group-rm",
    ])
    plan = plan_run(miles, "miles")
    assert plan.config.max_staleness == 1 and plan.flags.concurrency == 512
    assert plan.flags.reward == "miles-group:miles.rollout.rm_hub.batched_async_rm"
    assert "--shuffle" not in plan.feed_args and plan.data_dir is None


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        (["--multimodal-keys", '{"image": "img"}'], "--multimodal-keys"),
        (["--disable-rollout-global-dataset"], "--disable-rollout-global-dataset"),
        (["--apply-chat-template"], "--apply-chat-template needs --hf-checkpoint"),
    ],
)
def test_flags_rollstream_cannot_honour_are_refused(extra: list[str], text: str) -> None:
    argv = [*ROLLSTREAM_FLAGS, "--rollout-batch-size", "4", "--prompt-data", "x.jsonl", "--rm-type", "math",
            "--sglang-router-ip", "h", "--sglang-router-port", "1", *extra]
    with pytest.raises(ConfigError, match=text):
        plan_run(slime_parse(argv), "slime")


def test_a_run_without_dataset_reward_or_router_is_told_what_to_set() -> None:
    base = [*ROLLSTREAM_FLAGS, "--rollout-batch-size", "4", "--sglang-router-ip", "h", "--sglang-router-port", "1"]
    with pytest.raises(ConfigError, match="--prompt-data is not set"):
        plan_run(slime_parse([*base, "--rm-type", "math"]), "slime")
    with pytest.raises(ConfigError, match="without --custom-rm-path or --rm-type"):
        plan_run(slime_parse([*base, "--prompt-data", "x.jsonl"]), "slime")
    no_router = slime_parse([*ROLLSTREAM_FLAGS, "--rollout-batch-size", "4", "--rm-type", "m", "--prompt-data", "x"])
    assert plan_run(no_router, "slime").flags.engine is None  # miles starts its router after the data source
    with pytest.raises(ConfigError, match="--sglang-router-ip"):
        require_engine(no_router, None)


async def test_producers_start_once_the_framework_has_started_its_router(
    redis: Redis, redis_url: str, ns: str, sim: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """miles builds the data source, then starts the router and writes its address into args."""
    monkeypatch.setenv("ROLLSTREAM_REDIS_URL", redis_url)
    monkeypatch.setenv("ROLLSTREAM_NAMESPACE", ns)
    monkeypatch.setenv("ROLLSTREAM_CONSUMER_NAME", "t0")
    monkeypatch.setenv("ROLLSTREAM_START", "producers")
    from rollstream.integrations.miles import RollstreamDataSource

    args = miles_parse(["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--prompt-data", "x.jsonl",
                        "--rm-type", "contains", "--sglang-server-concurrency", "3"])
    source = RollstreamDataSource(args)
    try:
        assert source.pipeline.producers_started is False
        assert "engine" not in await RolloutFlagsHash(redis, Keys(ns)).read()
        args.sglang_router_ip, args.sglang_router_port = sim.url.removeprefix("http://").rsplit(":", 1)
        await asyncio.to_thread(source.load, -1)
        assert source.pipeline.producers_started is True
        assert (await RolloutFlagsHash(redis, Keys(ns)).read())["engine"] == sim.url
        await wait_until(lambda: redis.hexists(Keys(ns).producers, "t0-producer-0"), timeout=60,
                         message="the producer's heartbeat")
    finally:
        await asyncio.to_thread(source.close)


def test_a_custom_generate_function_goes_to_the_producers_through_the_adapter() -> None:
    args = slime_parse([*ROLLSTREAM_FLAGS, "--rollout-batch-size", "4", "--prompt-data", "x.jsonl", "--rm-type", "m",
                        "--sglang-router-ip", "h", "--sglang-router-port", "1", "--custom-generate-function-path", "g.f"])
    flags = plan_run(args, "slime").flags
    assert flags.generate == "slime:g.f"
    assert RolloutFlags.from_fields(flags.to_fields()).generate == "slime:g.f"  # stored for other nodes


def test_rollout_flags_from_redis_are_checked() -> None:
    with pytest.raises(ConfigError, match="concurrency='many'"):
        RolloutFlags.from_fields({"framework": "slime", "concurrency": "many"})
    with pytest.raises(ConfigError, match="sampling_params"):
        RolloutFlags.from_fields({"framework": "slime", "sampling_params": "[1]"})
    assert RolloutFlags.from_fields({}) == RolloutFlags(framework="unknown")


def test_start_components() -> None:
    assert components({}, redis_url_set=False) == ("redis", "feeder", "producers")
    assert components({}, redis_url_set=True) == ()
    assert components({"ROLLSTREAM_START": "producers,feeder"}, redis_url_set=True) == ("feeder", "producers")
    assert components({"ROLLSTREAM_START": "none"}, redis_url_set=True) == ()
    with pytest.raises(ConfigError, match="asks for redis"):
        components({"ROLLSTREAM_START": "redis"}, redis_url_set=True)
    with pytest.raises(ConfigError, match="unknown"):
        components({"ROLLSTREAM_START": "trainer"}, redis_url_set=False)


def test_feeder_builds_slimes_prompts_in_slimes_order(tmp_path: Path) -> None:
    """slime's Dataset: prompt from --input-key (one user message with --apply-chat-template),
    label from --label-key (none by default), metadata = the --metadata-key object plus the
    --tool-key tools; --rollout-shuffle: random.seed(seed + epoch) then random.shuffle."""
    path = tmp_path / "d.jsonl"
    rows = [
        {"input": "a", "label": "1", "metadata": {"src": "x"}, "tools": '[{"name": "calc"}]', "other": 1},
        {"input": [{"role": "user", "content": "b"}], "label": "2", "metadata": None},
        {"input": "c", "label": "3"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_jsonl(path, "input", "label", metadata_key="metadata", tool_key="tools", as_chat=True)
    assert records[0].prompt == [{"role": "user", "content": "a"}]
    assert records[0].metadata == {"src": "x", "tools": [{"name": "calc"}]}
    assert records[1].prompt == rows[1]["input"] and records[1].metadata == {}
    assert [r.label for r in records] == ["1", "2", "3"]
    no_label = load_jsonl(f"{path}@[1:]", "input", None, metadata_key="metadata")
    assert [r.label for r in no_label] == [None, None] and no_label[0].prompt == rows[1]["input"]



async def test_feeder_feeds_in_slimes_shuffle_order(redis: Redis, ns: str, tmp_path: Path) -> None:
    await make_namespace(redis, ns)
    records = load_jsonl(_dataset(tmp_path / "d.jsonl", 50), "input", "label", metadata_key="metadata")
    settings = FeedSettings(namespace=ns, epochs=2, window=1000, shuffle=True, seed=42, shuffle_scheme="slime")
    assert await Feeder(redis, records, settings).run() == 100
    fed = [decode_prompt_entry(f) for _, f in await redis.xrange(Keys(ns).prompts)]
    expected = []
    for epoch in range(2):
        random.seed(42 + epoch)  # slime's Dataset.shuffle(epoch)
        order = list(range(50))
        random.shuffle(order)
        expected += order
    assert [p.metadata["dataset_index"] for p in fed] == expected
    assert [p.label for p in fed[:3]] == [str(i) for i in expected[:3]]
    assert fed[0].metadata["row"] == expected[0]  # the --metadata-key object


# -- the stored flags, read by `rollstream produce` ------------------------------------------


async def test_produce_takes_what_the_command_line_leaves_out_from_the_stored_flags(
    redis: Redis, ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await make_namespace(redis, ns)
    stored = RolloutFlags(
        framework="slime", engine="http://router:1", concurrency=96, reward="slime:user_rm.rm",
        reward_args='{"rm_type": "math"}', tokenizer="fake_tokenizer:FakeChatTokenizer", max_new_tokens=512,
        temperature=0.7, top_p=0.95, sampling_params={"top_k": 5},
    )
    await RolloutFlagsHash(redis, Keys(ns)).replace(stored.to_fields())
    read = await RolloutFlagsHash(redis, Keys(ns)).read()
    assert read["reward"] == "slime:user_rm.rm" and read["concurrency"] == "96"  # readable with redis-cli
    monkeypatch.setenv("ROLLSTREAM_REWARD_ARGS", "")

    args = build_parser().parse_args(["produce", "--ns", ns, "--engine", "http://e:1", "--temperature", "1.0"])
    options = produce_options(args, read)
    assert (options.producer.concurrency, options.reward, options.tokenizer, options.engine.max_new_tokens) == (
        96, "slime:user_rm.rm", "fake_tokenizer:FakeChatTokenizer", 512)
    assert (options.engine.temperature, options.engine.top_p) == (1.0, 0.95)  # an explicit flag wins
    assert options.engine.sampling_params == {"top_k": 5}
    assert os.environ["ROLLSTREAM_REWARD_ARGS"] == '{"rm_type": "math"}'

    bare = build_parser().parse_args(["produce", "--ns", ns, "--engine", "http://e:1"])
    with pytest.raises(ConfigError, match="needs --concurrency and --reward"):
        produce_options(bare, {})
    bare = build_parser().parse_args(["produce", "--ns", ns, "--engine", "http://e:1", "--concurrency", "4",
                                      "--reward", "math"])
    options = produce_options(bare, {})
    assert options.engine.sampling_params == {} and (options.engine.max_new_tokens, options.engine.temperature) == (
        1024, 1.0)
    await RolloutFlagsHash(redis, Keys(ns)).replace({"framework": "slime"})
    assert await RolloutFlagsHash(redis, Keys(ns)).read() == {"framework": "slime"}  # replaced whole
    assert Keys(ns).rollout_flags in Keys(ns).all_keys()  # `ns delete` deletes it


# -- supervision ------------------------------------------------------------------------------


def _state(pid: int) -> str | None:
    """The /proc state letter of ``pid`` (None: gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def _children_of(parent: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent and fields[0] not in ("Z", "X"):
                out.add(int(entry.name))
    return out


def _processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains ``text`` (psutil-free /proc scan)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and _alive(int(entry.name)):
            found.append((int(entry.name), cmdline))
    return found


SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
TERM_MARKER = textwrap.dedent("""
    import pathlib, signal, sys, time
    out = pathlib.Path(sys.argv[1])
    def on_term(*_):
        out.write_text("SIGTERM")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    out.with_suffix(".ready").write_text("1")
    time.sleep(600)
""")


async def test_supervisor_restarts_a_dead_child_with_a_backoff_and_stops_them_all(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from rollstream.common.backoff import Backoff

    caplog.set_level(logging.INFO, logger="rollstream.runtime.children")
    supervisor = Supervisor(tmp_path / "logs", backoff=Backoff(0.1, 0.5), pids_file=tmp_path / "children.json")
    try:
        sleeper = supervisor.start(ChildSpec("sleeper", SLEEPER))
        done = supervisor.start(ChildSpec("done", [sys.executable, "-c", "print('bye')"]))
        assert sleeper.process is not None and done.process is not None
        first = sleeper.process.pid
        await wait_until(lambda: _alive(first), message="the sleeper runs")
        assert json.loads((tmp_path / "children.json").read_text())["sleeper"] == first
        os.kill(first, signal.SIGKILL)
        await wait_until(lambda: supervisor.restarts()["sleeper"] == 1 and sleeper.process.pid != first
                         and _alive(sleeper.process.pid), message="the sleeper restarted")
        await wait_until(lambda: done.done, message="the finished child noticed")
        assert supervisor.restarts()["done"] == 0  # exit 0 is not a failure
        assert any("sleeper" in r.message and "signal SIGKILL" in r.message and "restarting it" in r.message
                   for r in caplog.records)
        second = sleeper.process.pid
        failing = supervisor.start(ChildSpec("failing", [sys.executable, "-c", "raise SystemExit(3)"], give_up_after=3))
        await wait_until(lambda: "failing" in supervisor.failed(), timeout=60, message="the failing child given up")
        assert "exited with code 3 3 times in a row" in supervisor.failed()["failing"]
        assert supervisor.restarts()["failing"] == 2 and failing.process.poll() == 3  # type: ignore[union-attr]
        graceful = supervisor.start(ChildSpec("graceful", [sys.executable, "-c", TERM_MARKER, str(tmp_path / "termed")]))
        await wait_until(lambda: (tmp_path / "termed.ready").exists(), message="the graceful child is ready")
    finally:
        await asyncio.to_thread(supervisor.stop)
    assert not _alive(second) and not _alive(graceful.process.pid)  # type: ignore[union-attr]
    assert (tmp_path / "termed").read_text() == "SIGTERM"  # stopped with SIGTERM first, not killed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
async def test_children_die_with_their_owner_even_on_sigkill(tmp_path: Path) -> None:
    """The owner (a stand-in trainer) is SIGKILLed: its supervised children go too (parent-death
    signal), nothing is left behind."""
    script = textwrap.dedent(f"""
        import sys, time
        from rollstream.runtime.children import ChildSpec, Supervisor
        s = Supervisor({str(tmp_path / "logs")!r}, pids_file={str(tmp_path / "children.json")!r})
        s.start(ChildSpec("a", {SLEEPER!r}))
        s.start(ChildSpec("b", {SLEEPER!r}))
        print("ready", flush=True)
        time.sleep(600)
    """)
    owner = await asyncio.to_thread(subprocess.Popen, [sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(owner.stdout.readline), 60)  # type: ignore[union-attr]
        assert line.strip() == b"ready"
        pids = json.loads((tmp_path / "children.json").read_text())
        assert set(pids) == {"a", "b"} and all(_alive(p) for p in pids.values())
        owner.kill()
        await asyncio.to_thread(owner.wait)
        await wait_until(lambda: not any(_alive(p) for p in pids.values()), timeout=30,
                         message="the children died with their owner")
    finally:
        owner.kill()
        owner.wait()


async def test_a_run_with_a_redis_url_starts_nothing(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollstream.integrations.slime import RollstreamDataSource

    await make_namespace(redis, ns)
    monkeypatch.setenv("ROLLSTREAM_REDIS_URL", redis_url)
    monkeypatch.setenv("ROLLSTREAM_NAMESPACE", ns)
    monkeypatch.setenv("ROLLSTREAM_CONSUMER_NAME", "t0")
    monkeypatch.delenv("ROLLSTREAM_START", raising=False)
    before = _children_of(os.getpid())
    args = slime_parse([*ROLLSTREAM_FLAGS, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                        "--prompt-data", str(_dataset(tmp_path / "d.jsonl", 4)), "--rm-type", "math",
                        "--sglang-router-ip", "127.0.0.1", "--sglang-router-port", "1", "--save", str(tmp_path / "c")])
    source = RollstreamDataSource(args)
    try:
        await asyncio.to_thread(source.load, -1)
        assert source.pipeline is None
        assert _children_of(os.getpid()) == before
        assert not (tmp_path / "c" / "rollstream").exists()
        assert not await redis.exists(Keys(ns).rollout_flags)
    finally:
        await asyncio.to_thread(source.close)


async def test_a_shared_redis_run_grows_with_producers_started_by_one_command(
    redis: Redis, redis_url: str, ns: str, sim: Any, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ROLLSTREAM_REDIS_URL names a shared Redis and ROLLSTREAM_START=feeder: the run initialises the
    namespace from its flags, stores its rollout flags and feeds; the producers are another
    node's, started with `rollstream produce --redis URL --ns NS --engine URL` and nothing else."""
    host, port = sim.url.removeprefix("http://").rsplit(":", 1)
    monkeypatch.setenv("ROLLSTREAM_REDIS_URL", redis_url)
    monkeypatch.setenv("ROLLSTREAM_NAMESPACE", ns)
    monkeypatch.setenv("ROLLSTREAM_CONSUMER_NAME", "t0")
    monkeypatch.setenv("ROLLSTREAM_START", "feeder")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDINS), os.environ.get("PYTHONPATH")])))
    args = slime_parse([
        *ROLLSTREAM_FLAGS, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--prompt-data", str(_dataset(tmp_path / "d.jsonl", 40)), "--label-key", "label",
        "--custom-rm-path", "user_rm.rm", "--rollout-max-response-len", "64", "--rollout-temperature", "0.5",
        "--sglang-router-ip", host, "--sglang-router-port", port, "--sglang-server-concurrency", "6",
        "--save", str(tmp_path / "ckpt"),
    ])
    rollout = importlib.import_module("slime.ray.rollout")
    manager = await asyncio.to_thread(rollout.RolloutManager, args)
    try:
        assert manager.data_source.pipeline.components == ("feeder",)
        config = (await redis.hgetall(Keys(ns).config))
        assert config[b"batch_size"] == b"4" and config[b"n_samples_per_prompt"] == b"2"
        remote = procs.start("produce", "--redis", redis_url, "--ns", ns, "--engine", sim.url, "--name", "node-b",
                             "--heartbeat-interval", "0.5", log_name="node-b")
        await asyncio.to_thread(manager.load, -1)
        for rollout_id in range(2):
            data, _ = await asyncio.wait_for(asyncio.to_thread(manager.generate, rollout_id), 60)
            assert len(set(data["group_indices"])) == 4
        beat = json.loads((await redis.hget(Keys(ns).producers, "node-b")) or b"{}")
        assert beat["concurrency"] == 6, procs.logs()  # the run's --sglang-server-concurrency x 1 engine
        assert "concurrency, reward, max_new_tokens, temperature, top_p from the run's stored rollout flags" in (
            procs.log_of(remote)
        )
        assert sorted(set(data["rewards"])) <= [0.0, 1.0]
    finally:
        await asyncio.to_thread(manager.data_source.close)
        await procs.astop_all()
    assert not (tmp_path / "ckpt" / "rollstream" / "redis").exists()  # no Redis of its own


async def test_a_parquet_prompt_data_is_streamed_by_the_runs_feeder(
    redis: Redis, redis_url: str, ns: str, sim: Any, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """slime's --prompt-data may be Parquet (its Dataset reads it): the run's feeder streams it
    with the run's keys (--input-key, --label-key, --metadata-key)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({
        "input": [f"what is {i}?" for i in range(40)], "label": [str(i) for i in range(40)],
        "metadata": [{"row": i} for i in range(40)],
    }), data, row_group_size=16)
    host, port = sim.url.removeprefix("http://").rsplit(":", 1)
    monkeypatch.setenv("ROLLSTREAM_REDIS_URL", redis_url)
    monkeypatch.setenv("ROLLSTREAM_NAMESPACE", ns)
    monkeypatch.setenv("ROLLSTREAM_CONSUMER_NAME", "t0")
    monkeypatch.setenv("ROLLSTREAM_START", "feeder")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDINS), os.environ.get("PYTHONPATH")])))
    args = slime_parse([
        *ROLLSTREAM_FLAGS, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--prompt-data", f"{data}@[8:40]", "--label-key", "label", "--rollout-shuffle",
        "--custom-rm-path", "user_rm.rm", "--rollout-max-response-len", "64",
        "--sglang-router-ip", host, "--sglang-router-port", port, "--sglang-server-concurrency", "6",
        "--save", str(tmp_path / "ckpt"),
    ])
    rollout = importlib.import_module("slime.ray.rollout")
    manager = await asyncio.to_thread(rollout.RolloutManager, args)
    try:
        procs.start("produce", "--redis", redis_url, "--ns", ns, "--engine", sim.url, "--name", "node-b",
                    "--heartbeat-interval", "0.5", log_name="node-b")
        await asyncio.to_thread(manager.load, -1)
        data_out, _ = await asyncio.wait_for(asyncio.to_thread(manager.generate, 0), 60)
        assert len(set(data_out["group_indices"])) == 4, procs.logs()
        queued = [decode_prompt_entry(f) for _, f in await redis.xrange(Keys(ns).prompts)]
        assert queued, "the feeder keeps the window filled"
        for prompt in queued:
            row = prompt.metadata["row"]
            assert 8 <= row < 40 and prompt.label == str(row) and prompt.metadata["dataset_index"] == row - 8
            assert prompt.prompt == f"what is {row}?"
    finally:
        await asyncio.to_thread(manager.data_source.close)
        await procs.astop_all()


async def test_a_run_mixes_named_sources_from_rollstream_mix(
    redis: Redis, redis_url: str, ns: str, sim: Any, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """slime has no flag for a mix: ROLLSTREAM_MIX is the namespace's, --prompt-data names the
    sources (NAME=PATH,...); every rollout's batch holds each source's share."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input": [f"what is {i}?" for i in range(30)], "label": [str(i) for i in range(30)],
                             "metadata": [{"row": i} for i in range(30)]}), tmp_path / "a.parquet")
    jsonl = _dataset(tmp_path / "b.jsonl", 30)
    host, port = sim.url.removeprefix("http://").rsplit(":", 1)
    for name, value in (("ROLLSTREAM_REDIS_URL", redis_url), ("ROLLSTREAM_NAMESPACE", ns),
                        ("ROLLSTREAM_CONSUMER_NAME", "t0"), ("ROLLSTREAM_START", "feeder"),
                        ("ROLLSTREAM_MIX", "a=1,b=3")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(STANDINS), os.environ.get("PYTHONPATH")])))
    argv = [
        *ROLLSTREAM_FLAGS, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--label-key", "label",
        "--custom-rm-path", "user_rm.rm", "--rollout-max-response-len", "64",
        "--sglang-router-ip", host, "--sglang-router-port", port, "--sglang-server-concurrency", "6",
        "--save", str(tmp_path / "ckpt"),
    ]
    with pytest.raises(ConfigError, match="--prompt-data must name each once"):
        plan_run(slime_parse([*argv, "--prompt-data", str(jsonl)]), "slime")
    args = slime_parse([*argv, "--prompt-data", f"a={tmp_path / 'a.parquet'},b={jsonl}"])
    rollout = importlib.import_module("slime.ray.rollout")
    manager = await asyncio.to_thread(rollout.RolloutManager, args)
    try:
        assert (await redis.hget(Keys(ns).config, "mix")) == b"a=1,b=3"
        procs.start("produce", "--redis", redis_url, "--ns", ns, "--engine", sim.url, "--name", "node-b",
                    "--heartbeat-interval", "0.5", log_name="node-b")
        await asyncio.to_thread(manager.load, -1)
        for rollout_id in range(2):
            data, _ = await asyncio.wait_for(asyncio.to_thread(manager.generate, rollout_id), 60)
            assert len(set(data["group_indices"])) == 4, procs.logs()
        state = {k.decode(): v.decode() for k, v in (await redis.hgetall(Keys(ns).sources)).items()}
        assert int(state["a:fed"]) > 0 and int(state["b:fed"]) > 0
        assert (int(state.get("a:committed", 0)), int(state.get("b:committed", 0))) in ((1, 3), (2, 6)), state
    finally:
        await asyncio.to_thread(manager.data_source.close)
        await procs.astop_all()


async def test_a_child_stopped_by_a_config_error_fails_the_rollout_instead_of_restarting(
    sim: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The feeder refuses the dataset (a line that is not JSON): restarting it would fail the same
    way forever, so it is not restarted and the waiting rollout raises the feeder's error."""
    for var in ("ROLLSTREAM_REDIS_URL", "ROLLSTREAM_START", "ROLLSTREAM_NAMESPACE", "ROLLSTREAM_CONSUMER_NAME"):
        monkeypatch.delenv(var, raising=False)
    dataset = _dataset(tmp_path / "d.jsonl", 3)
    dataset.write_text(dataset.read_text() + "{not json\n")
    host, port = sim.url.removeprefix("http://").rsplit(":", 1)
    args = slime_parse([*ROLLSTREAM_FLAGS, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                        "--prompt-data", str(dataset), "--rm-type", "contains", "--sglang-router-ip", host,
                        "--sglang-router-port", port, "--save", str(tmp_path / "ckpt")])
    rollout = importlib.import_module("slime.ray.rollout")
    manager = await asyncio.to_thread(rollout.RolloutManager, args)
    pids = json.loads((tmp_path / "ckpt" / "rollstream" / "children.json").read_text())
    try:
        with pytest.raises(ConfigError, match="two runs cannot share a --save directory"):
            await asyncio.to_thread(rollout.RolloutManager, args)  # a second run on the same --save
        await asyncio.to_thread(manager.load, -1)
        with pytest.raises(ConfigError, match=r"rollstream feeder stopped on a configuration error: .*d\.jsonl:4: not JSON"):
            await asyncio.wait_for(asyncio.to_thread(manager.generate, 0), 60)
        assert manager.data_source.pipeline.supervisor.restarts()["feeder"] == 0
    finally:
        await asyncio.to_thread(manager.data_source.close)
    assert not any(_alive(pid) for pid in pids.values())
    assert _processes_mentioning(str(tmp_path / "ckpt")) == []


# -- the whole run ----------------------------------------------------------------------------


def _trained(save: Path) -> list[dict[str, Any]]:
    path = save / "trained.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start_trainer(framework: str, argv: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    with open(log, "ab") as handle:
        return subprocess.Popen(
            [sys.executable, str(TRAINER), framework, *argv], stdout=handle, stderr=subprocess.STDOUT,
            env={**clean, **env},
        )


async def _ledger(data_dir: Path, ns: str) -> tuple[list[int], list[int], int]:
    """(indices left in the streams, dead-lettered indices, the feeder's next index) of a stopped run."""
    with EmbeddedRedis(dir=data_dir / "redis", appendonly=True) as server:
        redis = connect(server.url)
        try:
            keys = Keys(ns)
            left = [decode_group_entry(f).index for _, f in await redis.xrange(keys.groups)]
            left += [decode_prompt_entry(f).index for s in (keys.retry, keys.prompts) for _, f in await redis.xrange(s)]
            dead = [int(f[b"index"]) for _, f in await redis.xrange(keys.dead) if b"index" in f]
            next_index = int(await redis.hget(keys.state, StateField.FEED_NEXT_INDEX) or 0)
            assert await Journal(redis, ns, "trainer").rollout_ids()  # the journal survived both runs
        finally:
            await redis.aclose()
    return left, dead, next_index


async def _one_flag_run_killed_and_resumed(
    framework: str, argv: list[str], tmp_path: Path, *, batch: int, rollouts: int, save_interval: int, kill_after: int,
    child_to_kill: str = "producer-0",
) -> None:
    save = tmp_path / "ckpt"
    argv = [*argv, "--save", str(save), "--load", str(save), "--save-interval", str(save_interval),
            "--num-rollout", str(rollouts)]
    first = _start_trainer(framework, argv, tmp_path / "trainer-1.log", ONE_FLAG_HANG_AFTER=str(kill_after))
    try:
        def progress(count: int) -> bool:
            assert first.poll() is None, (tmp_path / "trainer-1.log").read_text()[-3000:]
            return len([e for e in _trained(save) if "rollout" in e]) >= count

        await wait_until(lambda: progress(2), timeout=180, message="the first run trained 2 rollouts")
        victim = json.loads((save / "rollstream" / "children.json").read_text())[child_to_kill]
        os.kill(victim, signal.SIGKILL)  # a child dies: the supervisor restarts it, the run goes on
        await wait_until(lambda: progress(kill_after + 1) and any(e.get("hanging") == kill_after for e in _trained(save)),
                         timeout=180,
                         message=f"the first run trained {kill_after + 1} rollouts")
        assert first.poll() is None
        children = json.loads((save / "rollstream" / "children.json").read_text())
        assert set(children) == {"redis", "feeder", "producer-0"}
        assert all(_alive(pid) for pid in children.values())
        first.send_signal(signal.SIGKILL)  # the trainer crashes
        await asyncio.to_thread(first.wait)
    finally:
        first.kill()
        first.wait()
    await wait_until(lambda: not any(_alive(pid) for pid in children.values()), timeout=30,
                     message="the first run's children died with it")
    assert _processes_mentioning(str(save)) == []
    run1 = {e["rollout"]: e for e in _trained(save) if "rollout" in e}
    assert sorted(run1) == list(range(kill_after + 1))
    assert children[child_to_kill] != victim and run1[kill_after]["children_restarted"] >= 1
    checkpoint = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert checkpoint < kill_after  # some trained rollouts were not checkpointed: they must be replayed

    second = _start_trainer(framework, argv, tmp_path / "trainer-2.log")
    try:
        code = await asyncio.wait_for(asyncio.to_thread(second.wait), 240)
    finally:
        second.kill()
        second.wait()
    logs = (tmp_path / "trainer-2.log").read_text()[-3000:]
    assert code == 0, logs
    assert "the name is held by" not in logs  # the dead run's name lease was released, not waited out
    assert _processes_mentioning(str(save)) == [], "the resumed run left processes behind"
    run2 = {e["rollout"]: e for e in _trained(save) if "rollout" in e and e["pid"] == second.pid}
    assert sorted(run2) == list(range(checkpoint + 1, rollouts))
    for rollout in range(checkpoint + 1, kill_after + 1):  # trained after the checkpoint: the same groups again
        assert run2[rollout]["groups"] == run1[rollout]["groups"] and run2[rollout]["replayed"] == 1.0
    for rollout in range(kill_after + 1, rollouts):
        assert run2[rollout]["replayed"] == 0.0
    lineage = [g for r in range(checkpoint + 1) for g in run1[r]["groups"]]
    lineage += [g for r in range(checkpoint + 1, rollouts) for g in run2[r]["groups"]]
    assert len(lineage) == len(set(lineage)) == rollouts * batch  # nothing trained twice
    left, dead, next_index = await _ledger(save / "rollstream", framework)
    assert dead == []
    assert not set(left) & set(lineage)
    assert sorted([*lineage, *left]) == list(range(next_index))  # nothing lost


async def test_slime_one_flag_run_is_killed_and_resumes_exactly(sim: Any, tmp_path: Path) -> None:
    """Only slime's own flags plus the rollout-function and data-source paths: no ROLLSTREAM_*
    variable, no rollstream command. Killed (SIGKILL) after rollout 5 with checkpoint 3, resumed."""
    host, port = sim.url.removeprefix("http://").rsplit(":", 1)
    argv = [
        *ROLLSTREAM_FLAGS, "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--prompt-data", str(_dataset(tmp_path / "prompts.jsonl", 200)), "--label-key", "label",
        "--rollout-shuffle", "--custom-rm-path", "user_rm.rm", "--rollout-max-response-len", "64",
        "--sglang-router-ip", host, "--sglang-router-port", port, "--sglang-server-concurrency", "8",
    ]
    await _one_flag_run_killed_and_resumed("slime", argv, tmp_path, batch=4, rollouts=9, save_interval=4, kill_after=5)


@pytest.mark.slow
async def test_miles_one_flag_run_is_killed_and_resumes_exactly(sim: Any, tmp_path: Path) -> None:
    """The same with miles' rollout class, chat prompts rendered by the producers' tokenizer
    (--apply-chat-template with --hf-checkpoint), --max-weight-staleness, a group reward, and the
    embedded Redis SIGKILLed mid-run (restarted on its AOF; everyone reconnects)."""
    host, port = sim.url.removeprefix("http://").rsplit(":", 1)
    argv = [
        "--rollout-function-path", "rollstream.integrations.miles.RollstreamRolloutFn",
        "--data-source-path", "rollstream.integrations.miles.RollstreamDataSource",
        "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--max-weight-staleness", "2",
        "--prompt-data", str(_dataset(tmp_path / "prompts.jsonl", 200)), "--label-key", "label",
        "--apply-chat-template", "--hf-checkpoint", "fake_tokenizer:FakeChatTokenizer",
        "--custom-rm-path", "user_rm.miles_group_rm", "--group-rm", "--rollout-max-response-len", "64",
        "--sglang-router-ip", host, "--sglang-router-port", port, "--sglang-server-concurrency", "6",
    ]
    await _one_flag_run_killed_and_resumed(
        "miles", argv, tmp_path, batch=3, rollouts=8, save_interval=3, kill_after=4, child_to_kill="redis"
    )


def test_standins_are_on_the_path() -> None:
    assert str(STANDINS) in sys.path
