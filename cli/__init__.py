"""The ``rollstream`` command line: one module per group of commands (see ``main.py``).

``rollstream server / init / feed / produce / sim-engine / pause / resume / release-trainer / demo / inspect
/ dead / ns / archive`` (``cli.archive_commands``); a thin layer over the packages above
(``cli.shared_options``: shared flags, ``--redis`` from ``$ROLLSTREAM_REDIS_URL``; ``cli.produce``:
``ProduceOptions``, the root of the settings tree, from which ``produce``'s flags, the stored-flags fallback
and the defaults are derived)
"""
