"""The error that reports bad input (a file, a config, a prompt) in one line: every layer raises it."""


class TracelmError(Exception):
    """An error caused by the user's input (file, config, prompt): reported as one line, exit 2."""
