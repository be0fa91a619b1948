"""Packed arrays: token ids, log-probs and loss masks as :class:`array.array` (``'i'``, ``'f'``,
``'B'``) or zero-copy memoryviews of those formats, and :class:`Packed`, an n-dimensional array
as one flat packed array in its smallest exact dtype and a shape (what the codec moves as bytes)."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeAlias

from .errors import PayloadNotFetched
from .imports import require_extra

IntArray: TypeAlias = "array[int] | memoryview[int]"
"""Packed ints: an ``array`` (``'i'`` ids, ``'B'`` masks) or a zero-copy ``memoryview`` of that format."""
FloatArray: TypeAlias = "array[float] | memoryview[float]"
"""Packed float32s: an ``array('f')`` or a zero-copy ``memoryview`` of format ``'f'``."""


PACKED_CODES = ("B", "H", "i", "f")
"""Typecodes a :class:`Packed` holds: uint8, uint16, int32 (the integer ladder) and float32."""
_INT_LIMITS = (("B", 0, 0xFF), ("H", 0, 0xFFFF), ("i", -(2**31), 2**31 - 1))
_NUMPY_NAMES = {"B": "uint8", "H": "uint16", "i": "int32", "f": "float32"}


def smallest_int_code(lo: int, hi: int) -> str:
    """The smallest typecode of the integer ladder that holds every value in ``lo..hi`` exactly."""
    for code, low, high in _INT_LIMITS:
        if low <= lo and hi <= high:
            return code
    raise ValueError(f"integer values {lo}..{hi} do not fit in int32")


def _shape_of(values: object) -> tuple[int, ...]:
    shape = []
    while isinstance(values, list | tuple):
        shape.append(len(values))
        if not values:
            break
        values = values[0]
    return tuple(shape)


def _flatten(values: Any, depth: int) -> list[Any]:
    for _ in range(depth - 1):
        values = [x for row in values for x in row]
    return list(values)


@dataclass(slots=True, eq=False)
class Packed:
    """An n-dimensional array as one flat packed array and a shape (rows first).

    ``data`` is an ``array`` or, in groups from ``take()``, a memoryview on the entry's bytes
    (zero-copy); :meth:`numpy` is a view on it. Build one with :meth:`of` (nested lists, numpy
    arrays, torch tensors, or a flat buffer with a shape), which picks the smallest exact dtype.
    """

    data: Any
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        code = _code_of(self.data)
        if code not in PACKED_CODES:
            raise ValueError(f"a Packed array holds one of {PACKED_CODES}, got {code!r}")
        self.shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in self.shape) or math.prod(self.shape) != len(self.data):
            raise ValueError(f"shape {self.shape} does not match {len(self.data)} values")

    @property
    def typecode(self) -> str:
        return _code_of(self.data)

    @property
    def row_size(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def nbytes(self) -> int:
        size: int = len(self.data) * self.data.itemsize
        return size

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    @classmethod
    def of(cls, values: Any, shape: Sequence[int] | None = None, *, floats: bool = False) -> Packed:
        """``values`` packed: a Packed as it is; a numpy array or torch tensor (any int dtype,
        narrowed to the smallest exact one; floats become float32); nested lists; or a flat
        sequence with ``shape``. ``floats`` packs as float32 instead of integers."""
        if isinstance(values, Packed):
            return values
        if isinstance(values, Unfetched):
            values._refuse("packing it")
        if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor
            values = values.detach().cpu()
            if str(values.dtype) in ("torch.bfloat16", "torch.float16"):  # numpy has no bfloat16
                values = values.float()
            values = values.numpy()
        if hasattr(values, "dtype") and hasattr(values, "astype") and hasattr(values, "shape"):
            return cls._of_ndarray(values, floats)
        if shape is None and _code_of(values):  # a flat packed array: one dimension
            shape = (len(values),)
        if shape is None:
            shape = _shape_of(values)
            flat = _flatten(values, len(shape)) if shape else []
        else:
            flat = values
        shape = tuple(shape)
        if floats or _code_of(flat) == "f":
            return cls(flat if _code_of(flat) == "f" else array("f", flat), shape)
        if _code_of(flat) in ("B", "H", "i"):
            data: Any = flat
            if len(flat):
                code = smallest_int_code(min(flat), max(flat))
                if code != _code_of(flat):
                    data = array(code, flat)
            return cls(data, shape)
        ints = flat if isinstance(flat, list) else list(flat)
        code = smallest_int_code(min(ints), max(ints)) if ints else "B"
        return cls(array(code, ints), shape)

    @classmethod
    def _of_ndarray(cls, values: Any, floats: bool) -> Packed:
        shape = tuple(int(d) for d in values.shape)
        kind = values.dtype.kind
        if floats or kind == "f":
            code = "f"
        elif kind in "iub":
            code = smallest_int_code(int(values.min()), int(values.max())) if values.size else "B"
        else:
            raise ValueError(f"cannot pack an array of dtype {values.dtype}")
        data = array(code)
        data.frombytes(values.astype(_NUMPY_NAMES[code]).tobytes())  # native order, C-contiguous copy
        return cls(data, shape)

    def numpy(self) -> Any:
        """A numpy array of this shape sharing the memory (read-only for groups from ``take()``)."""
        np = require_extra("numpy", "numpy", "numpy views of packed arrays")
        return np.frombuffer(self.data, dtype=_NUMPY_NAMES[self.typecode]).reshape(self.shape)

    def tolist(self) -> list[Any]:
        flat: list[Any] = self.data.tolist()
        for d in reversed(self.shape[1:]):
            flat = [flat[i : i + d] for i in range(0, len(flat), d)]
        return flat

    def rows(self, stop: int) -> Packed:
        """The first ``stop`` rows (a view when ``data`` is a memoryview)."""
        stop = max(0, min(stop, len(self)))
        return Packed(self.data[: stop * self.row_size], (stop, *self.shape[1:]))

    def concat(self, other: Packed) -> Packed:
        """These rows followed by ``other``'s (a copy, in the smallest dtype holding both)."""
        if self.shape[1:] != other.shape[1:]:
            raise ValueError(f"cannot append rows of shape {other.shape[1:]} to rows of shape {self.shape[1:]}")
        if "f" in (self.typecode, other.typecode):
            return Packed(array("f", [*self.data, *other.data]), (len(self) + len(other), *self.shape[1:]))
        codes = [c for c, _, _ in _INT_LIMITS]
        code = codes[max(codes.index(self.typecode), codes.index(other.typecode))]
        data = array(code, self.data)
        data.extend(other.data if _code_of(other.data) == code else array(code, other.data))
        return Packed(data, (len(self) + len(other), *self.shape[1:]))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Packed):
            return NotImplemented
        return self.shape == other.shape and self.data.tolist() == other.data.tolist()

    def __repr__(self) -> str:
        return f"Packed({self.typecode}, shape={self.shape})"


class Unfetched:
    """A sample's array that is in the payload store and not fetched yet: its length, shape,
    typecode and size are known (the entry says them), its values are not. ``len()`` works, so
    every length rule (``prompt_length``, the decoder's checks, ``Batch.shard``'s balance) holds
    before the fetch; any read of the values (indexing, iteration, ``tolist``, ``tobytes``,
    ``data``, ``numpy``, ``numpy.asarray``) raises :class:`~.errors.PayloadNotFetched` saying how
    to fetch. The buffer protocol: on Python 3.12 and later the same error; on 3.11 a pure-Python
    class cannot refuse it, so ``memoryview(x)`` and ``numpy.frombuffer(x)`` give the interpreter's
    ``TypeError``. Never None and never a short array: None still means "absent". Fetching
    (``GroupPayload.attach``) replaces it in its sample with the array itself."""

    __slots__ = ("key", "name", "shape", "typecode")

    def __init__(self, name: str, key: str, typecode: str, shape: tuple[int, ...]) -> None:
        self.name = name
        """The :class:`~.models.Sample` field."""
        self.key = key
        """The payload store object it is in."""
        self.typecode = typecode
        self.shape = shape

    def __len__(self) -> int:
        return self.shape[0] if self.shape else 0

    @property
    def format(self) -> str:
        """The typecode (a memoryview's name for it)."""
        return self.typecode

    @property
    def itemsize(self) -> int:
        return array(self.typecode).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def row_size(self) -> int:
        return math.prod(self.shape[1:])

    def _refuse(self, what: str = "its values") -> NoReturn:
        raise PayloadNotFetched(
            self.key,
            f"Sample.{self.name} ({self.typecode}, shape {self.shape}) is in the payload store, not fetched: "
            f"{what} cannot be read yet. Fetch the batch first: `await batch.fetch()` (or `batch.fetch_now()`, "
            f"any numpy view such as `batch.tokens_numpy()`, or `batch.shard(rank, world_size)` then its fetch); "
            f"lengths are known before the fetch (a `keep` filter runs before any fetch: lengths, rewards and "
            f"versions only)",
        )

    def __getitem__(self, index: object) -> NoReturn:
        self._refuse("an item or a slice")

    def __iter__(self) -> NoReturn:
        self._refuse("iterating it")

    def __contains__(self, value: object) -> NoReturn:
        self._refuse("a membership test")

    def __buffer__(self, flags: int) -> NoReturn:  # Python 3.12+ (PEP 688)
        self._refuse("its buffer")

    def __array__(self, *args: object, **kwargs: object) -> NoReturn:
        self._refuse("a numpy array of it")

    @property
    def data(self) -> NoReturn:
        self._refuse("its data")

    def tolist(self) -> NoReturn:
        self._refuse("tolist()")

    def tobytes(self) -> NoReturn:
        self._refuse("tobytes()")

    def numpy(self) -> NoReturn:
        self._refuse("numpy()")

    def __reversed__(self) -> NoReturn:
        self._refuse("iterating it")

    def cast(self, *args: object) -> NoReturn:  # a memoryview's
        self._refuse("cast()")

    def hex(self, *args: object) -> NoReturn:
        self._refuse("hex()")

    def rows(self, stop: int) -> NoReturn:  # a Packed's
        self._refuse("rows()")

    def concat(self, other: object) -> NoReturn:
        self._refuse("concat()")

    def __repr__(self) -> str:
        return f"Unfetched({self.name}, {self.typecode}, shape={self.shape}, key={self.key!r})"


_STR_METHODS = frozenset(name for name in dir(str) if not name.startswith("_"))


class UnfetchedText:
    """A sample's response text that is in the payload store (its UTF-8 bytes in the sample's
    object) and not fetched yet: ``len()`` gives its length in characters (the entry's ``ofl``
    spec records it beside the byte count, ``nbytes``), and truthiness follows it. Every other use
    raises :class:`~.errors.PayloadNotFetched` saying how to fetch: ``str()``, ``format`` and
    f-strings, ``==`` and ordering, hashing, slicing and indexing, iteration, ``in``, ``+`` and
    ``%``, and every ``str`` method (``sample.response.startswith(...)``). ``json.dumps`` of it
    gives json's own ``TypeError`` (json asks nothing of an object it does not know). Never an empty
    or partial string. Fetching (``GroupPayload.attach``) replaces it with the decoded text."""

    __slots__ = ("chars", "key", "name", "nbytes")

    def __init__(self, name: str, key: str, nbytes: int, chars: int) -> None:
        self.name = name
        """The :class:`~.models.Sample` field (``response``)."""
        self.key = key
        """The payload store object it is in."""
        self.nbytes = nbytes
        """Its length in UTF-8 bytes."""
        self.chars = chars
        """Its length in characters (what ``len()`` gives)."""

    def __len__(self) -> int:
        return self.chars

    def _refuse(self, what: str = "its text") -> NoReturn:
        raise PayloadNotFetched(
            self.key,
            f"Sample.{self.name} ({self.chars} characters, {self.nbytes} bytes of UTF-8) is in the payload store, "
            f"not fetched: {what} cannot be read yet. Fetch the batch first: `await batch.fetch()` (or "
            f"`batch.fetch_now()`, any numpy view such as `batch.tokens_numpy()`, or `batch.shard(rank, world_size)` "
            f"then its fetch); its length is known before the fetch",
        )

    def __str__(self) -> NoReturn:
        self._refuse("str()")

    def __format__(self, spec: str) -> NoReturn:
        self._refuse("formatting it")

    def __eq__(self, other: object) -> NoReturn:
        self._refuse("a comparison")

    def __ne__(self, other: object) -> NoReturn:
        self._refuse("a comparison")

    def __lt__(self, other: object) -> NoReturn:
        self._refuse("a comparison")

    __le__ = __gt__ = __ge__ = __lt__

    def __hash__(self) -> NoReturn:
        self._refuse("its hash")

    def __getitem__(self, index: object) -> NoReturn:
        self._refuse("a character or a slice")

    def __iter__(self) -> NoReturn:
        self._refuse("iterating it")

    def __contains__(self, value: object) -> NoReturn:
        self._refuse("a membership test")

    def __add__(self, other: object) -> NoReturn:
        self._refuse("concatenating it")

    __radd__ = __mul__ = __rmul__ = __add__

    def __mod__(self, other: object) -> NoReturn:
        self._refuse("%-formatting it")

    __rmod__ = __mod__

    def __bytes__(self) -> NoReturn:
        self._refuse("bytes()")

    def __getattr__(self, name: str) -> Any:
        if name in _STR_METHODS:  # sample.response.strip(), .split(), .encode(), ...
            self._refuse(f".{name}()")
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"UnfetchedText({self.name}, {self.chars} characters, {self.nbytes} bytes, key={self.key!r})"


def _code_of(values: object) -> str:
    if isinstance(values, array):
        return values.typecode
    if isinstance(values, memoryview):
        return values.format
    return ""


def _packed(values: object, typecode: str) -> bool:
    if isinstance(values, array):
        return values.typecode == typecode
    return isinstance(values, memoryview) and values.format == typecode and values.ndim == 1


def int_array(values: Iterable[int] | None) -> IntArray:
    if _packed(values, "i") or isinstance(values, Unfetched):  # a placeholder until fetched
        return values  # type: ignore[return-value]
    return array("i", values or ())


def float_array(values: Iterable[float] | None) -> FloatArray:
    if _packed(values, "f") or isinstance(values, Unfetched):  # a placeholder until fetched
        return values  # type: ignore[return-value]
    return array("f", values or ())


def mask_array(values: Iterable[int] | None) -> IntArray:
    if _packed(values, "B") or isinstance(values, Unfetched):  # a placeholder until fetched
        return values  # type: ignore[return-value]
    return array("B", values or ())
