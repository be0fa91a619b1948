"""A batch of taken groups, :class:`Batch`: its zero-copy numpy views (extra ``numpy``) and its metrics."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import math
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollstream.common import bias
from rollstream.common.arrays import FloatArray, IntArray, Packed
from rollstream.common.checked import is_int
from rollstream.common.errors import ConfigError
from rollstream.common.imports import require_extra
from rollstream.common.models import SAMPLE_FIELDS, Group
from rollstream.common.payload.plane import PayloadPlane
from rollstream.common.protocol import TakeStats
from rollstream.common.sample_fields import Kind

from .verdict import RECYCLE_COUNTERS, Cause, Route, Verdict

if TYPE_CHECKING:
    import numpy


@dataclass(slots=True)
class Batch:
    """Exactly ``target`` groups, sorted by index, and what it took to get them."""

    id: str
    """Stable across redelivery: derived from the stream entry ids of the groups."""
    groups: list[Group]
    entry_ids: list[bytes]
    metrics: dict[str, float] = field(default_factory=dict)
    weight_version: int = 0
    redelivered: bool = False
    """True when (some of) these groups were taken before, by an earlier incarnation."""
    bias: Counter[str] = field(default_factory=Counter, repr=False)
    """What committing the batch adds to the bias ledger (:mod:`rollstream.common.bias`)."""
    plane: PayloadPlane | None = field(default=None, repr=False)
    """The payload store its groups' offloaded arrays are fetched from (None: every array is in
    the groups already)."""

    def __len__(self) -> int:
        return len(self.groups)

    # -- the payload plane: arrays fetched on first access, each rank its share -------------

    @property
    def unfetched(self) -> list[Group]:
        """The groups whose offloaded arrays are not in their samples yet."""
        return [g for g in self.groups if g.payload is not None and not g.payload.attached]

    @property
    def store_bytes(self) -> int:
        """Bytes of this batch's objects in the payload store (fetched or not)."""
        return sum(g.payload.nbytes for g in self.groups if g.payload is not None)

    async def fetch(self) -> None:
        """Fetch the offloaded arrays of this batch's groups (a shard's: only its own) and put
        them in their samples as views on the fetched buffers (``fs``: mapped files, no copy);
        every object's CRC-32 is verified. ``PayloadError`` (naming the store and the key) when
        one cannot be read: a wrong array never reaches training. Done already: nothing to do.
        The numpy views call it themselves; until then an offloaded field is an ``Unfetched``
        placeholder (its length known, its values refused)."""
        pending = self.unfetched
        if not pending:
            return
        if self.plane is None:
            raise ConfigError("this batch's groups have offloaded arrays but no payload store to fetch them from")
        plane = self.plane
        fetched = await asyncio.gather(*(plane.fetch(g.payload) for g in pending if g.payload is not None),
                                       return_exceptions=True)
        for value in fetched:
            if isinstance(value, BaseException):
                raise value  # the first failure, naming its store and key
        for group, buffers in zip(pending, fetched, strict=True):
            if group.payload is not None and not isinstance(buffers, BaseException):
                group.payload.attach(group, buffers, plane.url)

    def fetch_now(self) -> None:
        """:meth:`fetch` from synchronous code (the numpy views, a training step): run in a
        thread of its own, so it works whether or not this thread runs an event loop."""
        if not self.unfetched:
            return
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollstream-fetch") as pool:
            pool.submit(asyncio.run, self.fetch()).result()

    def shard(self, rank: int, world_size: int) -> Batch:
        """This rank's share of the batch for data parallelism: whole groups, balanced by tokens
        (the largest first, each to the rank with the fewest tokens so far, ties by rank), the
        same split on every rank. Its offloaded arrays are fetched only for its own groups (on
        first access, or :meth:`fetch`), so each rank reads about ``1/world_size`` of the bytes.
        Commit the whole batch (the shards share its entries), from one rank."""
        if not is_int(world_size) or world_size < 1:
            raise ConfigError(f"world_size must be a positive integer, got {world_size!r}")
        if not is_int(rank) or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
        loads = [0] * world_size
        mine: list[int] = []
        order = sorted(range(len(self.groups)), key=lambda i: (-_tokens(self.groups[i]), i))
        for i in order:
            target = min(range(world_size), key=lambda r: (loads[r], r))
            loads[target] += _tokens(self.groups[i])
            if target == rank:
                mine.append(i)
        mine.sort()
        return Batch(
            id=f"{self.id}/{rank}of{world_size}", groups=[self.groups[i] for i in mine],
            entry_ids=[self.entry_ids[i] for i in mine], metrics=self.metrics, weight_version=self.weight_version,
            redelivered=self.redelivered, bias=Counter(), plane=self.plane,
        )

    def numpy_views(self, name: str) -> list[numpy.ndarray | None]:
        """Every sample's field ``name`` as a numpy array, groups in batch order, samples in group
        order, None where the field is unset: any field declared with a numpy view
        (``SampleField.numpy``: token ids ``int32``, log-probs ``float32``, masks ``uint8``, a
        ``Packed`` replay in its shape and wire dtype). Zero-copy: each array is a view on the
        sample's packed array, which for groups from ``take()`` is the entry's bytes as Redis sent
        them; it keeps that buffer alive, so it stays valid after :meth:`commit
        <GroupConsumer.commit>`, after the consumer is closed and after the batch is dropped. Such
        arrays are read-only (``.copy()`` one to modify it). Needs numpy (extra ``numpy``)."""
        view = _VIEWS.get(name)
        if view is None:
            raise ConfigError(f"Sample.{name} has no numpy view (fields with one: {', '.join(_VIEWS)})")
        self.fetch_now()  # offloaded arrays: fetched on first access (this batch's or shard's only)
        return [None if (value := getattr(s, name)) is None else view(value) for g in self.groups for s in g.samples]

    def tokens_numpy(self) -> list[numpy.ndarray]:
        """Every sample's ``tokens`` (prompt + response ids) as an ``int32`` view; as :meth:`numpy_views`."""
        return self.numpy_views("tokens")  # type: ignore[return-value]  # tokens are never None

    def log_probs_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's ``rollout_log_probs`` as a ``float32`` view (None where absent); as :meth:`numpy_views`."""
        return self.numpy_views("rollout_log_probs")

    def token_lags_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's per-token version lag, ``int32``, ``response_length`` long, aligned with
        :meth:`log_probs_numpy` (the behaviour log-probs): ``weight_version`` minus the version
        that generated each token (``Sample.token_versions``), so a trainer can correct or mask
        per token (TIS/MIS by lag). None for a sample with no version. Computed (not zero-copy),
        one small array per sample; needs numpy."""
        np = require_extra("numpy", "numpy", "numpy views of a batch")
        out: list[numpy.ndarray | None] = []
        for group in self.groups:
            for sample in group.samples:
                versions = sample.token_versions()
                if not versions and sample.oldest_version is None:
                    out.append(None)
                    continue
                lags = self.weight_version - np.frombuffer(versions, dtype=np.int32)
                out.append(np.maximum(lags, 0).astype(np.int32, copy=False))
        return out

    def loss_masks_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's ``loss_mask`` as a ``uint8`` view (None where absent); as :meth:`numpy_views`."""
        return self.numpy_views("loss_mask")

    def routed_experts_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's routing replay (R3) as a ``(len(tokens) - 1, layers, topk)`` view in its
        wire dtype (``uint8`` for up to 256 experts, ``uint16``, ``int32``; ``.astype`` for
        another), None where absent; as :meth:`numpy_views`."""
        return self.numpy_views("routed_experts")

    def indexer_topk_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's indexer top-k replay (DSA models), as :meth:`routed_experts_numpy`."""
        return self.numpy_views("indexer_topk")

    def top_p_numpy(self) -> list[tuple[numpy.ndarray, numpy.ndarray] | None]:
        """Every sample's nucleus replay as ``(token_ids, offsets)`` views (response token ``i``
        kept ``token_ids[offsets[i]:offsets[i + 1]]``), None where absent."""
        return [
            None if ids is None or offsets is None else (ids, offsets)
            for ids, offsets in zip(
                self.numpy_views("top_p_token_ids"), self.numpy_views("top_p_token_offsets"), strict=True
            )
        ]

    def teacher_log_probs_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's teacher log-probs (``response_length`` float32s), as :meth:`numpy_views`."""
        return self.numpy_views("teacher_log_probs")

    def opd_reverse_kl_numpy(self) -> list[numpy.ndarray | None]:
        """Every sample's OPD reverse-KL estimate (float32s), as :meth:`numpy_views`."""
        return self.numpy_views("opd_reverse_kl")


_NUMPY_DTYPES = {"i": "int32", "f": "float32", "B": "uint8", "H": "uint16"}


def _numpy_view(values: IntArray | FloatArray) -> numpy.ndarray:
    """A numpy array sharing ``values``' memory (the codec's arrays are native-endian)."""
    np = require_extra("numpy", "numpy", "numpy views of a batch")
    code = values.typecode if isinstance(values, array) else values.format
    view: numpy.ndarray = np.frombuffer(values, dtype=_NUMPY_DTYPES[code])
    return view


def _packed_view(packed: Packed) -> numpy.ndarray:
    view: numpy.ndarray = packed.numpy()
    return view


_VIEW_RULES: dict[Kind, Callable[[Any], numpy.ndarray]] = {
    Kind.IDS: _numpy_view, Kind.FLOATS: _numpy_view, Kind.MASK: _numpy_view, Kind.PACKED: _packed_view,
}
"""The numpy view of a field of each kind that has one."""
_VIEWS = {f.name: _VIEW_RULES[f.kind] for f in SAMPLE_FIELDS if f.numpy}


def _tokens(group: Group) -> int:
    return sum(len(s.tokens) for s in group.samples)


def batch_id(entry_ids: list[bytes]) -> str:
    """The batch's id: a digest of its entry ids, so a redelivered batch keeps it."""
    digest = hashlib.sha1(b"\n".join(sorted(entry_ids)), usedforsecurity=False).hexdigest()
    return f"b-{digest[:16]}"


_FATES = {Route.RECYCLE: "recycled", Route.DEAD_LETTER: "dead", Route.DROP: "filtered", Route.KEEP: "trained"}
"""A verdict's route -> its kind in the bias ledger."""


@dataclass(slots=True)
class Tally:
    """What one ``take()`` handed back, for the batch's metrics."""

    recycled: Counter[str] = field(default_factory=Counter)
    """Recycled groups of this take, by cause (the keys of RECYCLE_COUNTERS)."""
    dead_lettered: int = 0
    filtered: Counter[str] = field(default_factory=Counter)
    staleness_max_seen: int = 0
    """Over every decoded group of this take, recycled ones included (``staleness_max`` covers only the batch)."""
    recycled_by_source: Counter[str] = field(default_factory=Counter)
    """Recycled groups of this take by their source (named sources only)."""
    bias: Counter[str] = field(default_factory=Counter)
    """The bias ledger's increments of the hand-backs (recycled, dead-lettered, dropped): the
    consumer's own counter, kept across a cancelled take until a take's round trip adds them."""

    def saw(self, verdict: Verdict) -> None:
        """Count a verdict as judged (the hand-back itself is counted once Redis confirms it)."""
        if verdict.staleness is not None:
            self.staleness_max_seen = max(self.staleness_max_seen, verdict.staleness)
        if verdict.rejection is not None:
            self.filtered[verdict.rejection] += 1

    def handed_back(self, verdict: Verdict) -> None:
        """Count a recycle, dead letter or drop that Redis carried out."""
        if verdict.route == Route.RECYCLE:
            self.recycled[verdict.cause] += 1
            if verdict.group is not None and verdict.group.source:
                self.recycled_by_source[verdict.group.source] += 1
        elif verdict.route == Route.DEAD_LETTER:
            self.dead_lettered += 1
        if verdict.group is not None and verdict.cause != Cause.WRONG_SIZE:
            bias.deltas(verdict.group, _FATES[verdict.route], self.bias)


def batch_metrics(
    groups: list[Group],
    version: int,
    stats: TakeStats,
    tally: Tally,
    *,
    wait_s: float,
    alive: int,
    in_flight: int,
    blocked_delta_ms: int,
    staleness_rule: str = "newest_token",
) -> dict[str, float]:
    """:attr:`Batch.metrics`: the batch, the pipeline when it was taken, what the take handed back."""
    staleness = [g.staleness(version, staleness_rule) for g in groups]
    lag_total = lag_max = lag_count = 0
    for group in groups:
        total, worst, count = group.token_lags(version)
        lag_total, lag_max, lag_count = lag_total + total, max(lag_max, worst), lag_count + count
    rewards = [r for g in groups if not math.isnan(r := g.reward_mean)]
    metrics: dict[str, float] = {
        "groups": float(len(groups)),
        "weight_version": float(version),
        "wait_time_s": wait_s,
        "backlog": float(stats.groups_length - stats.groups_pending),
        "taken_uncommitted": float(stats.groups_pending),
        "in_flight_prompts": float(stats.prompts_pending),
        "in_flight_samples": float(in_flight),
        "producers_alive": float(alive),
        **{f"recycled_{kind}": float(tally.recycled[kind]) for kind in RECYCLE_COUNTERS},
        "dead_lettered": float(tally.dead_lettered),
        "filtered": float(sum(tally.filtered.values())),
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "staleness_max": float(max(staleness, default=0)),
        "staleness_max_seen": float(tally.staleness_max_seen),
        "token_lag_mean": lag_total / lag_count if lag_count else 0.0,
        "token_lag_max": float(lag_max),
        "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
        "admission_blocked_s": blocked_delta_ms / 1000,
    }
    for reason, count in tally.filtered.items():
        metrics[f"filtered/{reason}"] = float(count)
    metrics.update(source_metrics(groups, tally))
    return metrics


def row_stat_items(groups: list[Group], version: int) -> list[tuple[str, float, float, int, int]]:
    """(``<source>:<row>``, mean reward, reward variance, version, epoch) of each fed group with
    finite rewards: what ROW_STATS records for a curriculum."""
    items = []
    for group in groups:
        row = group.metadata.get("dataset_index")
        rewards = [r for s in group.samples if not math.isnan(r := s.scalar_reward)]
        if not is_int(row) or not rewards:
            continue
        mean = sum(rewards) / len(rewards)
        variance = sum((r - mean) ** 2 for r in rewards) / len(rewards)
        items.append((f"{group.source}:{row}", mean, variance, version, group.epoch))
    return items


def source_metrics(groups: list[Group], tally: Tally, sources: list[str] | None = None) -> dict[str, float]:
    """``source/<name>/groups``, ``reward_mean``, ``response_length`` (mean over samples) and
    ``recycled`` (this take) for every named source of the batch (and of ``sources``)."""
    by_source: dict[str, list[Group]] = {name: [] for name in sources or ()}
    for group in groups:
        if group.source:
            by_source.setdefault(group.source, []).append(group)
    for name in tally.recycled_by_source:
        by_source.setdefault(name, [])
    metrics: dict[str, float] = {}
    for name, mine in by_source.items():
        rewards = [r for g in mine if not math.isnan(r := g.reward_mean)]
        lengths = [s.response_length for g in mine for s in g.samples]
        metrics[f"source/{name}/groups"] = float(len(mine))
        metrics[f"source/{name}/reward_mean"] = sum(rewards) / len(rewards) if rewards else math.nan
        metrics[f"source/{name}/response_length"] = sum(lengths) / len(lengths) if lengths else math.nan
        metrics[f"source/{name}/recycled"] = float(tally.recycled_by_source[name])
    return metrics
