"""The trainer's side of rollstream: ``GroupConsumer`` (asyncio) and ``SyncGroupConsumer``,
``ArchiveReplay`` (recorded batches from an archive, the same ``take``/``commit``),
their options (``ConsumerOptions``) and the pure rule that routes each group (``judge``).

Every error a trainer can meet is exported here; all derive from :class:`RollstreamError`
(``ConfigError`` and ``DecodeError`` are also ``ValueError``). Redis connection problems
surface as redis-py's ``redis.exceptions.ConnectionError``.

Modules, one concern each:

* ``group_consumer``: ``GroupConsumer``: connect (``open``), the take loop (redelivery, orphans, reads),
  carrying out each verdict (one Lua script per hand-back), commit, the stall and health checks over one
  ``TrainerMonitor.diagnose()``
* ``options``: ``ConsumerOptions``: the trainer's options, listed once (``n_samples``, ``batch_size``,
  ``keep``, ``on_producer_failure``, ``stall_timeout``, ``warn_interval``, ``limits``, ``name_wait``),
  checked when built (``ConfigError``); ``ConsumerOptionArgs`` types them as ``connect(**options)`` /
  ``SyncGroupConsumer(**options)`` keyword arguments (a test keeps the two equal)
* ``verdict``: ``judge(fields, config, version=, staleness_limit=, keep=, limits=, stale=) -> Verdict``: the
  one pure rule for a group entry (``Cause``: undecodable, wrong size, failed, aborted, stale, filtered,
  usable; ``Route``: keep, recycle, drop, dead-letter, with the reason and the fields to write);
  ``RECYCLE_COUNTERS``, the stale-recycle constants
* ``mixing``: ``Mixer``: a take's quota per source (apportioned with the carry since the set of live sources
  last changed: ``base:<name>``, ``base_set`` in ``sources``); a source fed to the end with nothing alive
  leaves the mix (WARNING). ``take()`` holds groups over their source's quota (pending under its name,
  examined first by the next call) and re-checks quotas while it waits
* ``batch``: ``Batch`` (``numpy_views(field)`` for every field declared with a numpy view, and the shortcuts
  ``tokens_numpy()``, ``log_probs_numpy()``, ``loss_masks_numpy()`` & co.: zero-copy numpy views, extra
  ``numpy``), ``batch_id``, ``Tally`` and ``batch_metrics`` (``Batch.metrics``)
* ``biaswatch``: ``BiasWatch``: the batch's ``bias/...`` metrics from the ledger ``take()`` read, and the
  WARNING naming an under-trained bucket and its cause (issue 38)
* ``lateness``: ``StepClock``: steps are takes; a kept group admitted at step s (``Group.admitted_ms``,
  stamped at the first admission and kept across attempts) with a generation of g steps
  (``Group.generated_ms`` over the median step) is late past s + g + 1: ``lateness/...`` metrics, a WARNING
  with the cause read from its history, ``late_groups`` and ``late:<cause>`` in the state hash (issue 38)
* ``waiting``: why a take waits, no I/O: ``StallClock`` (seconds without a live producer, across takes),
  ``StaleStreak`` / ``StaleWatch`` (the stale streak that feeds ``judge``), ``wait_summary`` (the one-line
  cause), ``unrecovered_failure``
* ``lease``: ``NameHold``: the consumer name taken on connect (waiting up to ``name_wait``), renewed by a
  task, given up on close
* ``sync``: ``SyncGroupConsumer``: the same API on a ``LoopThread``
* ``archive_replay``: ``ArchiveReplay``: the trained batches of an archive in step order with ``take`` /
  ``commit`` (and ``take_next``, sync): the same ``Batch`` (id, groups in order, weight version, numpy views
  on the recorded bytes); ``ConfigError`` for another batch size, ``ReplayExhausted`` after the last; the
  integrations' ``ROLLSTREAM_REPLAY_ARCHIVE``
* ``evaluation``: ``GroupConsumer.evaluate`` (``submit_eval``: an eval set into the eval lane, returning at
  once) and ``eval_results`` (``finished_evals``: an eval whose prompts all came back is summarized, its
  groups archived as ``evaluated`` and deleted by Lua EVAL_COLLECT)
* ``connecting``: ``Connecting``: what ``connect()`` returns (await it, or ``async with``)
* ``filters``: the keep-filter verdict rule (``rejection_reason``: a reason string or falsy rejects, truthy
  keeps) and ``reward_variance``
"""

from rollstream.common.errors import (
    AllGroupsStale,
    ConfigError,
    ConsumerNameInUse,
    DecodeError,
    NamespaceGone,
    NamespaceNotInitialized,
    PipelineError,
    PipelineStalled,
    ProducerFailed,
    RedisDataLost,
    ReplayExhausted,
    RollstreamError,
)
from rollstream.common.eval_lane import EvalResult
from rollstream.common.models import Group, Sample, Status

from .archive_replay import ArchiveReplay
from .batch import Batch
from .filters import KeepFilter, rejection_reason, reward_variance
from .group_consumer import Connecting, GroupConsumer
from .options import ConsumerOptions
from .sync import SyncGroupConsumer
from .verdict import Cause, Route, Verdict, judge

__all__ = [
    "AllGroupsStale",
    "ArchiveReplay",
    "Batch",
    "Cause",
    "ConfigError",
    "Connecting",
    "ConsumerNameInUse",
    "ConsumerOptions",
    "DecodeError",
    "EvalResult",
    "Group",
    "GroupConsumer",
    "KeepFilter",
    "NamespaceGone",
    "NamespaceNotInitialized",
    "PipelineError",
    "PipelineStalled",
    "ProducerFailed",
    "RedisDataLost",
    "ReplayExhausted",
    "RollstreamError",
    "Route",
    "Sample",
    "Status",
    "SyncGroupConsumer",
    "Verdict",
    "judge",
    "rejection_reason",
    "reward_variance",
]
