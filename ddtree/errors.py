"""Errors that reach the user as one clear line."""


class UserError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with status 2."""


class CapacityError(ValueError):
    """Values that do not fit: more tokens than the model's context, or buffers larger than the device's free
    memory. Raised by the library before it allocates, in the words of the values (never of CLI flags); the CLI
    prints it on one line and exits with status 2."""
