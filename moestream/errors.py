"""The one exception type the command line turns into a single line and exit code 2, and how out-of-memory
failures are told apart from other errors (the CLI and the server both word them for the user)."""


class MoestreamError(Exception):
    """A problem with the user's input (file, flag, prompt): the message names the cause and a fix."""


def is_out_of_memory(e: BaseException) -> bool:
    """torch.OutOfMemoryError on a GPU; on the CPU the allocator raises a RuntimeError saying so."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or "out of memory" in text or "can't allocate memory" in text


class Terminated(Exception):
    """SIGTERM: the command stopped cleanly (memory freed); it exits 143 with one line, as 128 + the signal."""
