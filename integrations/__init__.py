"""Drop-ins for the frameworks our users train with: slime and miles.

* :mod:`rollstream.integrations.slime`: ``generate_rollout`` and ``RollstreamDataSource``;
* :mod:`rollstream.integrations.miles`: ``RollstreamRolloutFn`` and ``RollstreamDataSource``;
* :mod:`rollstream.integrations.convert`: rollstream groups <-> framework samples;
* :mod:`rollstream.integrations.framework_rewards`: ``--reward slime:pkg.module.fn`` for producers (registered with
  the one reward loader when imported), :mod:`rollstream.integrations.generate`: ``--generate slime:...``.

* :mod:`rollstream.integrations.flags` / :mod:`rollstream.integrations.pipeline`: the one-flag
  run, which starts its own Redis, feeder and producers from the framework's flags.

No framework is a dependency: their modules are imported when a function is called, never when
this package is. Configuration comes from the framework's own flags and ``ROLLSTREAM_*``
environment variables (:mod:`rollstream.integrations.environment`); see docs/integrations.md.
"""
