"""The wire format's versions and the bounded reading every decoder starts with: the payload's
size checked, msgpack read under :class:`CodecLimits`, the schema version checked."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from ..arrays import Unfetched
from ..errors import ConfigError, DecodeError
from ..models import SAMPLE_FIELDS

SCHEMA_VERSION = 4
"""The newest version this build writes: 4 for a group whose arrays went to the payload store
(``OFFLOAD_VERSION``), 3 for groups and prompts that use a version-3 field
(routing replay, teacher log-probs, ... see ``V3_SAMPLE_KEYS``); an entry without any is written
as version 2, byte for byte what the previous build wrote, so a trainer still on that build reads
it until a run turns the new fields on. Version 1 entries (before ``pl``, ``err`` and the filled
``lm``) are still read, so producers can be upgraded while a pipeline runs."""
OFFLOAD_VERSION = SCHEMA_VERSION
"""A group some of whose arrays left the entry for the payload store (``rollstream init
--payload-store``; docs/wire.md): written only then, so that a build that cannot fetch them
refuses the entry (``unknown_schema``) rather than reading samples without their arrays."""
READABLE_VERSIONS = (1, 2, 3, 4)
V3_SAMPLE_KEYS = tuple(f.key for f in SAMPLE_FIELDS if f.since >= 3)
"""Version-3 sample keys, each present only when its field is set: absent fields cost nothing."""
LITTLE = sys.byteorder == "little"


def le_bytes(values: array[Any] | memoryview[Any]) -> bytes | memoryview:
    """An array's little-endian bytes (the wire's): a byte view of it on a little-endian host (msgpack
    packs the buffer as bin, one copy, into the payload), a swapped copy elsewhere."""
    if LITTLE:
        try:
            return memoryview(values).cast("B")
        except TypeError:
            if isinstance(values, Unfetched):  # Python 3.11 cannot refuse the buffer itself: say why here
                values.tobytes()
            raise
    swapped = array(values.typecode, values)  # type: ignore[union-attr]  # pragma: no cover - big-endian: no views
    swapped.byteswap()  # pragma: no cover
    return swapped.tobytes()  # pragma: no cover


def from_le_bytes(typecode: str, raw: bytes | bytearray) -> array[Any]:
    """The array of ``typecode`` whose little-endian bytes are ``raw`` (a copy; checked lengths are
    the caller's: a length not a multiple of the item size raises ``ValueError``)."""
    values = array(typecode)
    values.frombytes(raw)
    if not LITTLE:  # pragma: no cover - big-endian hosts
        values.byteswap()
    return values

if array("i").itemsize != 4 or array("f").itemsize != 4:  # pragma: no cover - exotic platforms
    raise ImportError("rollstream needs 4-byte C int and float for its packed arrays")


@dataclass(frozen=True, slots=True)
class CodecLimits:
    """Upper bounds the decoder enforces, so a bad entry cannot exhaust memory."""

    max_payload_bytes: int = 512 * 1024 * 1024
    """Redis' own ``proto-max-bulk-len`` default: a group of 8 x 32k samples with a 48-layer
    top-8 routing replay is ~100 MiB."""
    max_samples: int = 4096
    max_tokens: int = 1 << 22
    max_string_bytes: int = 16 * 1024 * 1024
    max_container_len: int = 1 << 20
    max_array_items: int = 1 << 29
    """Items of one packed version-3 array (routing replay: tokens x layers x topk)."""

    def __post_init__(self) -> None:
        for name in ("max_payload_bytes", "max_samples", "max_tokens", "max_string_bytes", "max_array_items"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"CodecLimits.{name} must be positive")


DEFAULT_LIMITS = CodecLimits()


def check_payload(payload: object, limits: CodecLimits) -> None:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise DecodeError("bad_field", f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > limits.max_payload_bytes:
        raise DecodeError("too_large", f"payload of {len(payload)} bytes exceeds {limits.max_payload_bytes}")


def unpackb(payload: object, limits: CodecLimits) -> Any:
    return msgpack.unpackb(
        payload,
        raw=False,
        max_str_len=limits.max_string_bytes,
        max_bin_len=limits.max_payload_bytes,
        max_array_len=limits.max_container_len,
        max_map_len=limits.max_container_len,
        max_ext_len=0,
        strict_map_key=True,
    )


def unpack(payload: object, limits: CodecLimits) -> dict[str, Any]:
    check_payload(payload, limits)
    try:
        obj = unpackb(payload, limits)
    except Exception as exc:  # msgpack raises a zoo of types for malformed input
        raise DecodeError("not_msgpack", f"{type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise DecodeError("bad_field", f"payload must be a map, got {type(obj).__name__}")
    check_version(obj)
    return obj


def check_version(obj: Mapping[str, Any]) -> None:
    version = obj.get("v")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise DecodeError(
            "unknown_schema", f"schema version {version!r}, this build reads {', '.join(map(str, READABLE_VERSIONS))}"
        )

