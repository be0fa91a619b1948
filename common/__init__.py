"""Shared pieces of rollstream: data model, codec, Redis keys, config, Lua scripts, errors.

Modules, one concern each:

* ``keys``: every key, group and channel name; the ``state`` hash field names; the namespace SCAN pattern
* ``models``: ``Prompt``, ``Sample``, ``Group``, ``Status``, ``Adapter``; ``retry_prompt`` (the one group →
  prompt conversion); ``multimodal_of`` (a chat prompt's images)
* ``sample_fields``: how a sample field is declared: ``SampleField`` (wire key, ``Kind``: type and dtype
  rule, the wire version that introduced it, the length another field implies, the slime/miles field and
  class, whether ``Batch.numpy_views`` serves it), written on each ``Sample`` field with ``declare(...)``;
  ``models.SAMPLE_FIELDS`` lists them in wire order, and the model's coercions and equality, the codec
  (keys, version, encoding, checks, the zero-copy struct), the framework conversion, the batch's numpy views
  and ``testing.samples`` follow from it, each with one rule per kind (the hot functions,
  ``encode._sample_to_wire``, the decoder's readers and the model's coercion, are written out from the table
  at import, as ``dataclasses`` writes ``__init__``)
* ``arrays``: the packed arrays the model holds: ``int_array`` / ``float_array`` / ``mask_array`` (``array``
  or zero-copy ``memoryview``), ``Packed`` (an n-d integer/float32 array in its smallest exact dtype, with
  ``.numpy()`` views); re-exported by ``models``
* ``codec``: the wire format (schema 3, reads 1 and 2; writes 2 when no version-3 field is set): msgpack
  payloads; token ids / log-probs / loss masks / routing, indexer and top-p replay / teacher log-probs as
  packed little-endian arrays in ``bin`` fields; bounded decoding that raises only ``DecodeError``;
  zero-copy group decoding (``views=True``, below); ``group_too_large`` (the per-group size limit). A
  package, one module per seam: ``wire`` (versions, ``CodecLimits``, bounded msgpack reading), ``encode``,
  ``decode`` (every field check), ``zero_copy`` (the zero-copy path), ``entries`` (stream entries:
  ``group_fields``, ``prompt_fields``, ``decode_*_entry``); every name importable from
  ``rollstream.common.codec``
* ``admission``: the staleness-aware admission rule in Python (``admission_capacity``, the same arithmetic
  as ADMIT), the stall rule (``admission_stall``) and the cause of a waiting ``take()`` (``wait_cause``),
  shared by ``ops.health`` and the consumer
* ``attempts``: the one rule for a prompt's attempts: ``failure_reason(group)`` (``failed: <errors>`` /
  ``aborted``), ``past_max_attempts``, ``exhausted(group, config)`` (the dead letter of a group no take
  would accept); applied by the producer before it publishes and by ``judge()`` as the second line. An abort
  by a weight update (``by_weight_update``: the producer marks the samples when
  ``Control.updated_since(admitted version)``) keeps the attempt and is never dead-lettered
* ``bias``: the bias ledger, no I/O: each prompt's bucket per dimension (``prompt``, ``response`` length,
  ``attempts``, named ``source``; one entry of ``DIMENSIONS`` each), ``deltas(group, fate)`` (fed once per
  dimension, when its value is known for good; trained, dead, filtered, recycled), ``ledger(fields)`` with
  shares, ``short_buckets`` (below 0.8x the fed share beyond chance for the counts, with the cause); written
  by ``take()`` (hand-backs in
  ``mark_take``'s round trip, trained at ``commit``) and by the producer for its dead letters
  (``TrainerMonitor.add_bias``)
* ``protocol``: the Redis protocol layer, a package of bound classes (below, and ``ArchiveStream``: the
  archive stream, ``archive_stream.py``; ``EvalLane``, the eval lane, ``evals.py``): ``PromptQueue``,
  ``GroupQueue``, ``NameLease``, ``Control``,
  ``Feed``, ``Heartbeats``, ``EngineRegistry`` (the engine registry, ``engine_registry.py``), ``Keyspace``,
  ``DeadLetters``, ``JournalHash``, ``RolloutFlagsHash``, ``StreamView`` (every read of ``inspect``),
  ``Server`` (INFO, SCAN); NOGROUP / NOPERM / OOM translation
* ``heartbeat``: the producers' heartbeat, pure: ``Heartbeat`` (its fields typed once: parsing, the damage
  check and JSON follow), the one liveness rule ``alive(now, timeout)``, the one fold ``fold(raw, now,
  timeout) -> Fleet`` (members, alive names, in-flight samples, ADMIT refusals) behind ``live_producers`` /
  ``admission_refusals``
* ``redis_values``: the protocol layer's parsers of values read back from Redis (``text``, ``parse_int``,
  ``int_or``, ``damaged_fields``): a damaged value reads as a default and is named for ``inspect``, never
  raised on
* ``backoff``: ``Backoff``: the one exponential backoff with jitter (Redis outages, remote rewards, engine
  retries)
* ``versions``: ``parse_version`` / ``version_of``: the one parser of an engine's ``weight_version`` (the
  engine client, slime's router query, ``WeightSync.versions``)
* ``weight_apis``: ``WeightAPI``: each engine server's weight-update endpoints as data (pause per mode
  ``abort``/``wait``/``keep``, or none; the reload calls; the version label; resume; the version path), the
  bodies' ``WEIGHTS_PATH`` / ``VERSION`` slots filled per call; ``WEIGHT_APIS`` (``vllm``, ``sglang``): what
  ``WeightSync(kind=...)`` accepts; a dialect names its server's as ``weights``, and the producer's catch-up
  sends its ``catch_up_requests`` (the reload, then the label)
* ``loop_thread``: ``LoopThread``: an event loop in a daemon thread for synchronous callers
  (``SyncGroupConsumer``, the slime/miles glue) and for the producer's lease renewals (``producer.renewal``)
* ``watchdog``: ``LoopWatchdog``: the event loop's lag, measured by a ticker task every 0.1 s; a lag over
  the threshold (``default_stall_after``: a fifth of the lease, at most 5 s) is a ``Stall``, logged once
  when it ends with its length, the task that ran and where the loop was held (a daemon thread samples the
  loop thread's stack with ``sys._current_frames()`` while it stalls); run by the producer (heartbeat
  ``loop_*``, metrics), the feeder and the integrations' loop (issue 32); a stall the thread did not see
  either and during which the process used no CPU is the process stopped (SIGSTOP, a suspended machine):
  logged as such and counted apart (``stops``)
* ``urls``: ``check_url``: the one check of every engine URL that can reach the fleet (``--engine``,
  ``rollstream engines add``, the producer's reading of the registry): http(s) in any case, a host, a port
  in 1..65535, an IPv6 host in brackets; normalised (scheme lower-cased)
* ``cancellation``: ``raise_if_cancelled`` / ``being_cancelled`` / ``cancel_requests``: a cancellation
  swallowed by a library under a loop (Python 3.11 ``wait_for`` in redis-py) or raised by it as a
  connection error still ends the loop (producer loops, ``take()``, rewards) and is never retried as an
  outage (``Outage.run`` / ``Outage.forever`` mark ``cancel_requests()`` on entry and check after each try)
* ``archive_schema``: the archive's versioned Parquet schema (``SCHEMA_VERSION``, every column in
  docs/operations.md), ``ArchiveRecord`` (a record of the archive stream), ``record_row`` (readable columns
  + the entry's wire ``data``; big per-token arrays stripped unless kept), file naming and
  ``written_cursor``, ``read_table`` (every readable version, upgraded); pyarrow from the ``parquet`` extra,
  imported on first use
* ``eval_lane``: the eval lane's data: ``EvalSettings`` (name, ``n_samples``, ``max_new_tokens``, carried in
  an eval prompt's ``metadata["rollstream_eval"]``, read by the rollout: ``eval_settings``), ``eval_prompts``,
  ``EvalResult`` and ``summarize`` (metrics, versions with counts, lag in steps)
* ``datasets``: datasets streamed from disk, the feeder's and the eval lane's (``Dataset.records``): a
  folder or glob of shards, ``path@[a:b]``, rows numbered across the shards; ``RowFormat`` is slime's
  record shape (``--metadata-key``, ``--tool-key``, ``--as-chat``); ``Dataset.check`` parses the first rows
  of every shard at start
* ``shards``: one reader per file format (``JsonlShard``, ``ParquetShard`` via the ``parquet`` extra), each
  cut into units (≈1 MiB of lines, a row group) without reading rows; a file changed while it is fed is a
  ``ConfigError``
* ``walks``: ``EpochWalk``: an epoch's order from row ids alone, one class per order: ``BufferedWalk``
  (units permuted, rows through a seeded ``ShuffleBuffer``) and ``PermutedWalk`` (a dataset within the
  buffer, or slime's scheme, fully permuted), so a resume at any position replays ids and reads only the
  units still holding buffered rows. Memory: the buffer, not the dataset
* ``config``: ``PipelineConfig``, validated with ``ConfigError`` (a ``ValueError``), stored as a plain hash
* ``mix``: the mix (``init --mix NAME=WEIGHT,...``): ``parse_mix``, ``apportion`` (largest remainder) and
  ``carries`` (what each source is owed from the groups committed so far), so every batch holds each
  source's share and the long-run ratio is exact to the group
* ``scripts/``: the Lua scripts, one ``.lua`` file each (PUBLISH, MOVE, ACK_DELETE, ADMIT, FEED,
  JOURNAL_APPEND, LIMIT_ACQUIRE, ROW_STATS, EVAL_COLLECT...), its header naming its KEYS and ARGV; the
  shared preludes start with ``_`` (``_archive.lua``: the fate MOVE and ACK_DELETE decide is archived)
* ``lua``: ``load`` reads a script file into a ``Script`` (KEYS and ARGV bound as named Lua locals, state
  field names filled in from ``keys.StateField``, constant ARGV); the protocol seam that runs a script
  binds it (``Script.bind``) and shapes its reply; the byte ledger (below)
* ``connection``: clients for every URL form (``redis://``, ``rediss://``, ``unix://``,
  ``redis+sentinel://``, ``redis+cluster://``; password from the environment or a file; ``redact_url()``;
  optional ``WAIT`` after each script: docs/deploy.md; blocking readers get their own, with a socket timeout
  above BLOCK; at most ``MAX_CONNECTIONS`` (32) connections per client, more commands at once wait for one;
  a Cluster client keeps at most 32 commands in flight, as redis-py's node pools raise
  ``MaxConnectionsError`` past 100 instead of waiting) and ``Outage`` (bounded backoff, one log line per
  outage): ``Outage.run`` retries one call, ``Outage.forever`` is the one resilient loop step (the
  producer's renew, reclaim, heartbeat and control loops are each a turn under it)
* ``errors``: the exception hierarchy, drawn in its docstring (one root, ``RollstreamError``): every error a
  user can meet is defined there once, under the node that says what happens (a failed sample, a fatal
  producer, a ``take()`` that raises), and re-exported where it is raised
  (``producer.rewards.RewardBroken``, ``producer.engine.EngineReplyInvalid``, ...) and from ``rollstream``
  (the ones a user handles); every argument check raises ``ConfigError``; no class has two parents in the
  tree (``EngineError`` fatal, ``EngineRejected`` a failed sample, ``EpisodeAborted`` a recycle)
* ``logs``: ``Prefixed``, the logger adapter that starts a producer's, consumer's or feeder's lines with
  ``producer NAME (ns NS): `` (built once per object, ``tests/test_logs.py``)
* ``redis_errors``: Redis' refusals as rollstream errors: NOPERM → ``RedisPermissionDenied`` (command, user,
  ACL-template role), OOM → the transient ``RedisOutOfMemory``; ``translated`` / ``translate_errors`` used
  by the protocol modules
* ``events``: the capped ``events`` stream (lifecycle, fatal errors with tracebacks)
* ``imports``: the one importer of user code: ``import_object`` / ``import_callable`` for
  ``module:attribute``, ``path/to/file.py:attribute`` and (with ``dotted=True``, for slime's and miles'
  functions) ``package.module.attribute``; used by ``--reward``, ``--generate``, keep filters, the
  frameworks' eval and generate functions; ``require_extra`` for optional dependencies
"""
