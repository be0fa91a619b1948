"""How a sample's fields are declared: each field of :class:`~.models.Sample` carries one
:class:`SampleField` (its wire key, its :class:`Kind`, the wire version that introduced it, the
slime/miles ``Sample`` field it becomes) as dataclass metadata, written with :func:`declare`.

:data:`~.models.SAMPLE_FIELDS` lists them in wire order; the model's coercions and equality,
the codec (keys, version, encoding, checks, the zero-copy struct), the framework conversion and
the batch's numpy views are derived from it, each with one rule per :class:`Kind`. A new field of
an existing kind is one declaration (and its tests); ``tests/test_sample_fields.py`` fails when a
kind has no rule in one of them. Pure data: no import of the model or the codec."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal


class Kind(enum.StrEnum):
    """What a field holds, which fixes its Python type, its wire form and its dtype rule."""

    INT = "int"
    """A plain int."""
    TEXT = "text"
    """A string."""
    OPT_TEXT = "opt_text"
    """A string or None."""
    REWARD = "reward"
    """A number, a map of numbers, or None."""
    STATUS = "status"
    """A :class:`~.models.Status` (its value on the wire)."""
    VERSIONS = "versions"
    """A list of ints."""
    IDS = "ids"
    """Token ids: int32, a little-endian ``bin`` on the wire."""
    FLOATS = "floats"
    """float32 per token, a little-endian ``bin`` on the wire (None: absent)."""
    MASK = "mask"
    """uint8 per token, a ``bin`` on the wire (None: absent)."""
    PACKED = "packed"
    """A :class:`~.arrays.Packed` of ``ndim`` dimensions in its smallest exact dtype:
    ``[typecode, shape, bin]`` on the wire; an ``int32`` numpy array for the frameworks."""
    MAP = "map"
    """A map of plain data."""
    COUNTERS = "counters"
    """A map of ints (the frameworks' ``framework_type`` class: ``SpecInfo``, ...)."""
    FLAG = "flag"
    """A bool, set when True."""
    GROUP_ID = "group_id"
    """An int shared by samples of one rollout execution (None: one per sample); the frameworks
    number it within the run (``group_index * n + id``)."""
    SECONDS = "seconds"
    """A finite float, set when not zero."""
    ADAPTER = "adapter"
    """An :class:`~.models.Adapter`: ``[name, slot]`` on the wire."""
    MEDIA = "media"
    """Processed media: plain values and :class:`~.arrays.Packed` tensors (numpy for the frameworks)."""
    SPANS = "spans"
    """``(start, end, version)`` triples over the response, flat on the wire."""


BIN_CODES = {Kind.IDS: "i", Kind.FLOATS: "f", Kind.MASK: "B"}
"""The kinds that travel as one packed ``bin``, and their typecode."""
SET_WHEN_TRUE = (Kind.FLAG, Kind.SECONDS)
"""Kinds whose field is set when true (a FLAG when True, SECONDS when not zero); a field of
another kind is set when not None. An optional field that is not set costs no byte."""

Length = Literal["response", "rows", "rows_or_media", "offsets"]
"""A length checked on decode: ``response_length`` items; ``len(tokens) - 1`` rows (more with
processed media present, for ``rows_or_media``); ``response_length + 1`` offsets from 0 to the
length of the paired field."""


@dataclass(frozen=True, slots=True)
class SampleField:
    """One field of the sample, as every layer sees it."""

    name: str
    """The :class:`~.models.Sample` attribute (filled in from the dataclass field)."""
    key: str
    """The wire key."""
    kind: Kind
    since: int = 1
    """The wire version that introduced it: it is read from entries of that version on; a
    version-3 field is written only when set, and an entry with one is version 3; older fields
    are always written (``wvs``: when set)."""
    required: bool = False
    """Must be present in an entry (``missing_field`` otherwise)."""
    ndim: int = 1
    """Dimensions of a :attr:`Kind.PACKED` field."""
    length: Length | None = None
    pair: str | None = None
    """A field that travels with this one (both or neither: the top-p ids and offsets)."""
    framework: str | None = None
    """The slime/miles ``Sample`` field it becomes; kept in the framework sample's rollstream
    metadata entry when the framework has none. None: converted by ``integrations.convert`` itself
    (the fields every framework sample has)."""
    framework_type: str | None = None
    """The framework's class for it (``SpecInfo``, ``AdapterRef``), found beside its ``Sample``."""
    numpy: bool = False
    """``Batch.numpy_views(name)`` serves it: a zero-copy numpy view per sample."""

    @property
    def unset(self) -> Any:
        """The value of this field when it is not set (a version-3 field then costs no byte)."""
        return False if self.kind is Kind.FLAG else 0.0 if self.kind is Kind.SECONDS else None

    def is_set(self, value: object) -> bool:
        """Whether ``value`` differs from this field's unset value (see :data:`SET_WHEN_TRUE`)."""
        return bool(value) if self.kind in SET_WHEN_TRUE else value is not None

    @property
    def optional(self) -> bool:
        """Written only when set (version-3 fields and the spans)."""
        return self.since >= 3 or self.kind is Kind.SPANS


def declare(key: str, kind: Kind, **options: Any) -> dict[str, Any]:
    """The ``metadata=`` of a :class:`~.models.Sample` field: its :class:`SampleField` (named
    after the field when the table is built)."""
    return {"sample_field": SampleField(name="", key=key, kind=kind, **options)}
