"""The ``rollstream`` command line: one module per group of commands (see ``main.py``)."""
