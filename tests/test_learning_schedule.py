"""The learning-speed measurement's arithmetic (rollstream.testing.learning, issue 30): the
schedule a run's flags resolve to (and the contradictions refused), the importance ratio of the
off-policy correction (1 at staleness 0), the overlap bound, and the example's refusal of
contradictory flags from its command line."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
from rollstream.common.errors import ConfigError
from rollstream.testing.learning import (
    Bound,
    check_correction,
    first_reaching,
    median_and_range,
    quantile,
    ratio_stats,
    resolve_schedule,
)
from rollstream.testing.vllm_server import vllm_python

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("schedule", "staleness", "partial", "expected"),
    [
        ("sync", None, None, ("sync", 0, False)),
        ("one-off", None, None, ("one-off", 1, False)),
        ("async", None, None, ("async", 2, True)),
        ("async", 4, None, ("async", 4, True)),
        ("async", 2, False, ("async", 2, False)),
        ("one-off", 1, True, ("one-off", 1, True)),
        (None, 0, None, ("sync", 0, False)),
        (None, None, None, ("one-off", 1, False)),
        (None, 3, None, ("async", 3, True)),
    ],
)
def test_a_schedule_resolves_to_its_staleness_and_partial_rollout(
    schedule: str | None, staleness: int | None, partial: bool | None, expected: tuple[str, int, bool]
) -> None:
    got = resolve_schedule(schedule, staleness, partial)
    assert (got.name, got.max_staleness, got.partial_rollout) == expected


@pytest.mark.parametrize(
    ("schedule", "staleness", "partial", "message"),
    [
        ("sync", 1, None, "--schedule sync means --max-staleness 0, got 1"),
        ("sync", 2, None, "--schedule sync means --max-staleness 0, got 2"),
        ("sync", None, True, "nothing is in flight"),
        ("one-off", 0, None, "--schedule one-off means --max-staleness 1, got 0"),
        ("one-off", 2, None, "use --schedule async"),
        ("async", 1, None, "--schedule async needs --max-staleness >= 2 (got 1)"),
        ("async", 0, None, "needs --max-staleness >= 2"),
        (None, -1, None, "must be >= 0"),
        ("sometimes", None, None, "must be one of sync, one-off, async"),
    ],
)
def test_contradictory_flags_are_refused_with_a_clear_error(
    schedule: str | None, staleness: int | None, partial: bool | None, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        resolve_schedule(schedule, staleness, partial)
    assert message in str(caught.value)


def test_the_correction_and_its_cap_are_checked() -> None:
    for kind in ("none", "tis", "mis"):
        check_correction(kind, 2.0)
    with pytest.raises(ConfigError, match="--correction must be one of"):
        check_correction("ppo", 2.0)
    for cap in (1.0, 0.5, math.inf, math.nan):
        with pytest.raises(ConfigError, match="--is-cap"):
            check_correction("tis", cap)


def test_the_bound_is_sync_g_plus_t_over_the_slower_side() -> None:
    bound = Bound(generate_s=0.3, train_s=0.2)
    assert bound.sync_step == pytest.approx(0.5)
    assert bound.async_step == pytest.approx(0.3)
    assert bound.speedup == pytest.approx(5 / 3)
    assert bound.fraction(1.5) == pytest.approx(0.9)
    balanced = Bound(1.0, 1.0)
    assert balanced.speedup == pytest.approx(2.0)  # the most overlap can give
    assert Bound(0.1, 1.0).speedup == pytest.approx(1.1)  # trainer-bound: little to hide


def test_ratio_stats_quantiles_and_the_first_reach() -> None:
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert quantile([5.0], 0.99) == 5.0
    stats = ratio_stats({1: [float(v) for v in range(101)], 0: [1.0, 1.0], 2: []})
    assert list(stats) == ["0", "1"]  # ordered by staleness, empty levels left out
    assert stats["1"]["p1"] == pytest.approx(1.0) and stats["1"]["p99"] == pytest.approx(99.0)
    assert stats["1"]["mean"] == pytest.approx(50.0) and stats["1"]["tokens"] == 101
    assert stats["0"]["max_dev"] == 0.0
    points = [(0, 0.0, 0.2), (2, 1.5, 0.29), (4, 3.0, 0.31), (6, 4.5, 0.4)]
    assert first_reaching(points, 0.3) == (4, 3.0)
    assert first_reaching(points, 0.5) is None
    assert median_and_range([3.0, math.nan, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert all(math.isnan(v) for v in median_and_range([math.nan]))


def test_the_importance_ratio_is_one_at_staleness_zero_and_truncated_or_masked_above_the_cap() -> None:
    torch = pytest.importorskip("torch")
    from rollstream.testing.learning import importance_weights

    behaviour = torch.log(torch.tensor([0.9, 0.05, 0.3, 0.6], dtype=torch.float32))
    same = behaviour.clone().requires_grad_(True)  # on-policy: the trainer holds the behaviour weights
    for kind in ("none", "tis", "mis"):
        weights, ratio = importance_weights(same, behaviour, kind, 2.0)
        assert torch.equal(ratio, torch.ones_like(ratio, dtype=torch.float64))
        assert torch.equal(weights, torch.ones_like(weights)) and not weights.requires_grad
    # trainer log-probs of a newer policy: ratios 0.5, 1, 3, 4
    newer = behaviour + torch.log(torch.tensor([0.5, 1.0, 3.0, 4.0]))
    _, ratio = importance_weights(newer, behaviour, "tis", 2.0)
    assert torch.allclose(ratio, torch.tensor([0.5, 1.0, 3.0, 4.0], dtype=torch.float64), rtol=1e-6)
    tis, _ = importance_weights(newer, behaviour, "tis", 2.0)
    mis, _ = importance_weights(newer, behaviour, "mis", 2.0)
    none, _ = importance_weights(newer, behaviour, "none", 2.0)
    assert torch.allclose(tis, torch.tensor([0.5, 1.0, 2.0, 2.0]), rtol=1e-6)
    assert torch.allclose(mis, torch.tensor([0.5, 1.0, 0.0, 0.0]), rtol=1e-6)
    assert torch.equal(none, torch.ones(4))


def test_tokens_lagging_past_the_limit_are_masked_out_of_the_loss() -> None:
    np = pytest.importorskip("numpy")
    from rollstream.testing.learning import mask_by_lag

    weights = np.array([0.5, 1.0, 2.0, 1.5], dtype=np.float32)
    lags = np.array([3, 3, 1, 0], dtype=np.int32)  # a continued sample: its first tokens are older
    assert mask_by_lag(weights, lags, None) == (weights, 0)
    masked, dropped = mask_by_lag(weights, lags, 2)
    assert masked.tolist() == [0.0, 0.0, 2.0, 1.5] and dropped == 2
    assert mask_by_lag(weights, lags, 3)[1] == 0


@pytest.mark.skipif(vllm_python() is None, reason="the example imports torch: needs the vLLM venv (scripts/vllm-env)")
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--schedule", "sync", "--max-staleness", "1"], "--schedule sync means --max-staleness 0, got 1"),
        (["--schedule", "async", "--max-staleness", "1"], "--schedule async needs --max-staleness >= 2"),
        (["--engine-cpus", "0", "--trainer-cpus", "0"], "overlap"),
    ],
)
def test_the_example_refuses_contradictory_flags_before_it_starts_anything(flags: list[str], message: str) -> None:
    python = vllm_python()
    assert python is not None
    run = subprocess.run([python, str(ROOT / "examples" / "tiny_grpo.py"), *flags], capture_output=True, text=True,
                         timeout=110, check=False)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
