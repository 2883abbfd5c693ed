"""The ``ckptd`` command line: one module per subcommand, registered in ``ckptd.cli.main``."""
