"""The wire format: msgpack maps with a schema version, token arrays as packed bytes.

Token ids travel as little-endian int32, log-probs as little-endian float32 and loss masks as
uint8, each in a msgpack ``bin`` field: a group of 8 x 8k tokens is a handful of memcpys, not
131k msgpack integers. Decoding is bounded (payload size, array and string lengths) and turns
every malformed input into :class:`~rollstream.common.errors.DecodeError`, never anything else.

Stream entries carry a few plain fields beside ``data`` so that ``redis-cli XRANGE`` is readable
without msgpack.

Version 3 adds what slime and miles train on (see ``docs/wire.md`` for the table): the
routing, indexer and top-p replays as ``[typecode, shape, bin]`` triples in their smallest exact
dtype (``B`` uint8, ``H`` uint16, ``i`` int32), teacher log-probs and the OPD reverse KL as
float32 ``bin``, and small plain fields; each key is written only when its field is set.

**Zero-copy groups.** ``decode_group(..., views=True)`` (what ``take()`` uses) returns samples
whose ``tokens``, ``rollout_log_probs``, ``loss_mask`` and version-3 arrays (routing, indexer
and top-p replay, teacher log-probs, reverse KL) are memoryviews cast to their typecodes on the
payload bytes themselves, not copies: msgspec locates the ``bin`` fields of every sample
without copying them, and every other field is decoded by msgpack exactly
as the copying decoder does (same options, same limits). A payload the view path cannot read is
decoded again by the copying decoder, so malformed input gets exactly the same
:class:`DecodeError`. Views keep the payload bytes alive; big-endian hosts always co

One module per seam: :mod:`.wire` (versions, limits, bounded reading), :mod:`.encode`,
:mod:`.decode` (the copying decoder and every field check), :mod:`.zero_copy` (the zero-copy path),
:mod:`.entries` (stream entries); every name is importable from here.
"""

from .decode import check_lengths, decode_group, decode_prompt
from .encode import OFFLOADABLE, StoreObject, encode_group, encode_group_offloaded, encode_prompt
from .entries import (
    Fields,
    decode_group_entry,
    decode_prompt_entry,
    entry_data,
    group_fields,
    group_fields_offloaded,
    group_too_large,
    prompt_fields,
    prompt_fields_offloaded,
)
from .wire import DEFAULT_LIMITS, OFFLOAD_VERSION, READABLE_VERSIONS, SCHEMA_VERSION, CodecLimits

__all__ = [
    "DEFAULT_LIMITS",
    "OFFLOADABLE",
    "OFFLOAD_VERSION",
    "READABLE_VERSIONS",
    "SCHEMA_VERSION",
    "CodecLimits",
    "Fields",
    "StoreObject",
    "check_lengths",
    "decode_group",
    "decode_group_entry",
    "decode_prompt",
    "decode_prompt_entry",
    "encode_group",
    "encode_group_offloaded",
    "encode_prompt",
    "entry_data",
    "group_fields",
    "group_fields_offloaded",
    "group_too_large",
    "prompt_fields",
    "prompt_fields_offloaded",
]
