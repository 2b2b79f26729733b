"""The one exception type the command line turns into a single line and exit code 2."""


class MoestreamError(Exception):
    """A problem with the user's input (file, flag, prompt): the message names the cause and a fix."""
