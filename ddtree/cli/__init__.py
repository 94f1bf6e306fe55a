"""The `ddtree` command: `main` in `ddtree.cli.main`, the subcommands beside it (bench, serve, analysis,
drafter), and what they share (`ddtree.cli.common`: help formatter, flag types, device flags)."""
