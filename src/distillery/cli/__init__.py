"""The ``distillery`` command line: one module per subcommand, dispatched lazily by :mod:`~distillery.cli.main`."""
