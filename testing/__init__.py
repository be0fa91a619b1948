"""Test and demo doubles: the engine simulator (:mod:`.sim`), samples with every field set
(:mod:`.samples`), the tiny real model and its learning arithmetic (:mod:`.tiny_model`,
:mod:`.learning`) and a real vLLM launcher (:mod:`.vllm_server`). Used by the tests, the
benchmarks and the CLI's ``sim-engine`` and ``demo``; library code never imports it
(``tests/test_layers.py``), so a trainer install does not need it. The embedded Redis and the
supervisor live in ``rollstream.runtime``."""
