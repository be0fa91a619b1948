"""The one backoff helper: exponential, capped, jittered downwards, checked settings."""

from __future__ import annotations

import pytest
from rollstream.common.backoff import Backoff
from rollstream.common.errors import ConfigError


def test_delays_double_up_to_the_cap_with_jitter_below_the_nominal_delay() -> None:
    backoff = Backoff(base=0.1, cap=1.0, jitter=0.5)
    for attempt, nominal in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (50, 1.0)]:
        delays = [backoff.delay(attempt) for _ in range(50)]
        assert all(nominal / 2 <= d <= nominal for d in delays)
    assert Backoff(base=0.1, cap=1.0, jitter=0).delay(2) == pytest.approx(0.4)


@pytest.mark.parametrize(("base", "cap", "jitter"), [(0, 1, 0.5), (2, 1, 0.5), (0.1, 1, 1.5)])
def test_bad_settings_raise_config_error(base: float, cap: float, jitter: float) -> None:
    with pytest.raises(ConfigError):
        Backoff(base=base, cap=cap, jitter=jitter)
