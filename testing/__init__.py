"""Test and demo infrastructure: the engine simulator, an embedded redis-server and child-process
helpers. Used by the demo, the benchmarks and the tests; library code (common, producer,
consumer, ops) never imports it, so a trainer install does not need it."""
