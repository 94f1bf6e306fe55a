"""The `ddtree` command: `main` in `ddtree.cli.main`, analysis and drafter subcommands beside it."""
