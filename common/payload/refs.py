"""What a stream entry keeps of the objects its arrays went to (pure data, no store, no Redis):
:class:`ObjectRef` (key, size, CRC-32) per object, :class:`Offloaded` per array (which object,
where in it, its typecode and shape), and :class:`GroupPayload`, a decoded group's both, which
puts the arrays back in their samples once the objects are fetched (:meth:`GroupPayload.attach`)."""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from ..errors import ConfigError, PayloadCorrupt

if TYPE_CHECKING:
    from ..models import Group

Buffer: TypeAlias = "bytes | bytearray | memoryview"
"""What a put takes and a get returns (anything with the buffer protocol, one byte per item)."""

MAX_KEY = 200
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")


def check_key(key: object) -> str:
    """``key`` when it is a store key rollstream writes (``[A-Za-z0-9._-]`` segments joined by
    ``/``, none starting with ``.`` or ``-``, at most 200 characters), else ``ConfigError``: a key
    can never name a path outside an ``fs`` store's directory."""
    if not isinstance(key, str) or len(key) > MAX_KEY or not _KEY.fullmatch(key):
        raise ConfigError(f"payload object key {key!r} is not [A-Za-z0-9._-] segments joined by '/'")
    return key


def checksum(parts: Iterable[Buffer]) -> int:
    """The CRC-32 (``zlib.crc32``, as in zip and PNG) of ``parts`` back to back: what an
    :class:`ObjectRef` records and a reader verifies."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """One object of the store as a group's entry refers to it."""

    key: str
    size: int
    """Bytes."""
    checksum: int
    """CRC-32 of the bytes (:func:`checksum`)."""

    def to_wire(self) -> list[Any]:
        return [self.key, self.size, self.checksum]

    @classmethod
    def from_wire(cls, value: object) -> ObjectRef:
        """The ref in ``value`` (``[key, size, crc32]``); ``ValueError`` when it is not one."""
        if (
            not isinstance(value, list | tuple) or len(value) != 3 or not isinstance(value[0], str)
            or type(value[1]) is not int or type(value[2]) is not int
            or value[1] < 0 or not 0 <= value[2] <= 0xFFFFFFFF
        ):
            raise ValueError("an object reference is [key, size, crc32]")
        try:
            check_key(value[0])
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return cls(value[0], value[1], value[2])



def object_keys(base: str, count: int) -> list[str]:
    """The keys of a group's ``count`` objects, named from one fresh ``base`` key:
    ``<base>-<count>.<i>``. Their member (:func:`group_member`) is ``<base>-<count>``."""
    return [f"{base}-{count}.{i}" for i in range(count)]


def group_member(keys: Sequence[str]) -> str:
    """The ledgers' one member for a group's object set (``payload_intents``, ``payload_held``,
    ``payload_free`` and the entry's ``refs`` field): the keys' common name ``<base>-<count>``
    when they are :func:`object_keys`, else the single key itself. A group's intent, claim,
    release and free are then one ledger command each, whatever its sample count."""
    if not keys:
        raise ValueError("a group member names at least one object")
    member = member_of(keys[0])
    if member_keys(member) != list(keys):
        raise ValueError(f"keys {list(keys)[:3]}... are not one group's object keys (object_keys)")
    return member


_MEMBER = re.compile(r".*-([0-9]{1,6})")


def member_keys(member: str) -> list[str]:
    """The object keys of a ledger member (:func:`group_member`): ``<base>-<n>`` names
    ``<base>-<n>.0`` ... ``<base>-<n>.<n-1>``; any other member is one key (the one-object-per-
    member form). The Lua side (``_helpers.lua``'s ``member_of``) reads the same rule backwards."""
    match = _MEMBER.fullmatch(member)
    if match is None:
        return [member]
    return [f"{member}.{i}" for i in range(int(match.group(1)))]


def member_of(key: str) -> str:
    """The ledger member a store key belongs to: ``<base>-<n>`` for ``<base>-<n>.<i>`` (with
    ``i < n``), else the key itself."""
    base, dot, index = key.rpartition(".")
    if dot and index.isdigit():
        match = _MEMBER.fullmatch(base)
        if match is not None and int(index) < int(match.group(1)):
            return base
    return key


@dataclass(frozen=True, slots=True)
class Offloaded:
    """One array of one sample that left the entry: ``nbytes`` bytes at ``offset`` of the group's
    object number ``obj``, items of ``typecode`` in ``shape`` (one dimension for a flat array)."""

    sample: int
    """The sample's position in its group."""
    name: str
    """The :class:`~..models.Sample` field."""
    obj: int
    offset: int
    nbytes: int
    typecode: str
    shape: tuple[int, ...]
    packed: bool
    """A :class:`~..arrays.Packed` field (else a flat array)."""
    chars: int | None = None
    """The response text (UTF-8 bytes, typecode ``B``): its length in characters; None for an array."""

    def spec(self) -> list[Any]:
        """What the entry's ``ofl`` keeps of it: ``[offset, bytes, typecode, shape]`` (the text: and its characters)."""
        spec = [self.offset, self.nbytes, self.typecode, list(self.shape)]
        return spec if self.chars is None else [*spec, self.chars]

    @property
    def items(self) -> int:
        return math.prod(self.shape)


@dataclass(slots=True)
class GroupPayload:
    """The objects of a decoded group and the arrays in them, until they are fetched."""

    objects: tuple[ObjectRef, ...]
    arrays: tuple[Offloaded, ...]
    attached: bool = False
    """The arrays are in their samples (fetched)."""

    @property
    def nbytes(self) -> int:
        return sum(ref.size for ref in self.objects)

    def attach(self, group: Group, buffers: Mapping[str, memoryview], store: str = "") -> None:
        """Put every array back in its sample as a view on ``buffers`` (the fetched objects by
        key, each already checked against its ref): a :class:`~..arrays.Packed` on a cast view, or
        the cast view itself for a flat array; the response text decoded from its UTF-8 bytes.
        Text that is not valid UTF-8, or not as many characters as its entry says, raises
        :class:`~..errors.PayloadCorrupt` naming ``store`` (the plane's URL) and the key, before
        any sample is changed: the group is recycled with that reason, never a mangled string."""
        from ..arrays import Packed

        texts: dict[Offloaded, str] = {}
        for array in self.arrays:
            if array.chars is None:
                continue
            key = self.objects[array.obj].key
            raw = buffers[key][array.offset : array.offset + array.nbytes]
            try:
                text = str(raw, "utf-8")
            except UnicodeDecodeError as exc:
                raise PayloadCorrupt(store or "(store)", key, f"Sample.{array.name} is not UTF-8: {exc}") from None
            if len(text) != array.chars:
                detail = f"Sample.{array.name} has {len(text)} characters, its entry says {array.chars}"
                raise PayloadCorrupt(store or "(store)", key, detail)
            texts[array] = text
        for array in self.arrays:
            value: Any = texts.get(array)
            if value is None:
                raw = buffers[self.objects[array.obj].key][array.offset : array.offset + array.nbytes]
                view = raw.cast("B").cast(array.typecode)  # type: ignore[call-overload]
                value = Packed(view, array.shape) if array.packed else view
            setattr(group.samples[array.sample], array.name, value)
        self.attached = True
