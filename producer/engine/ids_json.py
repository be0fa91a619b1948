"""The ids-to-JSON cache: a trajectory's token ids written as JSON once, not once per request.

Request bodies are encoded with :data:`ENCODER`, which takes an :class:`EncodedIds` (a copy made
by :meth:`IdsJson.ids`) as the JSON text written so far plus the ids added since.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec


class EncodedIds(array):
    """A copy of token ids (``array('i')``) that knows the :class:`IdsJson` of the array it was
    copied from, so the request body holding it takes the JSON text written so far instead of
    converting every id again: a multi-turn trajectory encodes each of its tokens once, not once
    per request. Built by :meth:`IdsJson.ids`; encoded when the body is (``_enc_hook``)."""

    __slots__ = ("cache", "length")
    cache: IdsJson
    length: int
    """``len`` when copied: a copy that grew or shrank since is encoded id by id."""


class IdsJson:
    """The JSON text of an append-only ``array('i')`` (a trajectory's tokens), extended by the
    ids added since it was last asked for."""

    __slots__ = ("_count", "_json", "_source")

    def __init__(self, source: array[int]) -> None:
        self._source = source
        self._json = b"[]"
        self._count = 0

    @property
    def source(self) -> array[int]:
        return self._source

    def ids(self) -> EncodedIds:
        """A copy of the ids now (what a request sends); its JSON is written when it is encoded."""
        ids = EncodedIds("i", self._source)
        ids.cache, ids.length = self, len(ids)
        return ids

    def json(self, ids: EncodedIds) -> bytes | None:
        """The JSON text of ``ids`` (a copy from :meth:`ids`: the source's first ``len(ids)`` ids),
        or None when it is older than the text written so far (then it is encoded id by id)."""
        count = len(ids)
        if count < self._count:
            return None
        if count > self._count:
            new = _IDS.encode(ids[self._count :].tolist())
            self._json = new if self._count == 0 else self._json[:-1] + b"," + new[1:]
            self._count = count
        return self._json


_IDS = msgspec.json.Encoder()


def _enc_hook(value: Any) -> Any:
    if isinstance(value, array):
        if type(value) is EncodedIds and len(value) == value.length:
            text = value.cache.json(value)
            if text is not None:
                return msgspec.Raw(text)
        return value.tolist()
    raise NotImplementedError(f"cannot encode {type(value).__name__} as JSON")


ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook)
