"""What a one-machine run needs besides the pipeline itself: an embedded redis-server
(:mod:`.redis_server`), the supervisor of child processes (:mod:`.children`) and the parent-death
wrapper its children run under (:mod:`.parent_death`). Imported by the CLI (``rollstream server``,
``demo``), the one-flag slime/miles run (``integrations.pipeline``) and the tests; it depends on
``common`` only."""
