"""Errors that reach the user as one clear line."""


class UserError(Exception):
    """Bad input from the user: the CLI prints the message on one line and exits with status 2."""


class CapacityError(ValueError):
    """Values that do not fit: more tokens than the model's context, or buffers larger than the device's free
    memory. Raised by the library before it allocates, in the words of the values (never of CLI flags); the CLI
    prints it on one line and exits with status 2."""


class SettingsError(ValueError):
    """A decode setting outside what it may be, in the words of the value: `setting` names it as the library
    does (`budget`, `topk`, `temperature`, `max_new_tokens`, ...), `problem` says the rule and the value. The
    one error of `ddtree.settings`; the CLI names the flag (`--budget must be >= 1, got 0`), the server the
    request's field (a 400)."""

    def __init__(self, setting: str, problem: str) -> None:
        super().__init__(f"{setting} {problem}")
        self.setting = setting
        self.problem = problem

    def named(self, name: str) -> str:
        """The message with the setting called `name` (a flag, a JSON field)."""
        return f"{name} {self.problem}"
