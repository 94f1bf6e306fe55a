"""Errors that reach the user as one clear line."""


class UserError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with status 2."""
