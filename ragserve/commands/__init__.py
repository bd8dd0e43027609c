"""One module per ``ragserve`` subcommand, each listed in :data:`ragserve.cli.COMMANDS`."""
