"""Render a model file's chat template, in a child process with hard limits.

A chat template is code that comes with the model file. Rendered in the sandbox transformers uses, it cannot
touch the system, but it can loop without end or build a string of any size in one call (`'a'.ljust(10**12)`,
a `replace` in a loop...). So it runs in a Python process of its own (only jinja2 imported) capped at 1 GiB of
address space and 2 s of CPU a rendering; whatever goes wrong comes back as one line. The processes stay for the
next rendering (starting one cost every chat request tens of milliseconds); one that failed is replaced.
"""

from __future__ import annotations

import atexit
import json
import math
import select
import subprocess
import sys
import threading
from datetime import datetime
from typing import Any

from moestream.errors import MoestreamError

MEMORY = 1 << 30
# the fix every template failure names, on the command line and in the server alike
WITHOUT_CHAT = "write the prompt in the model's own format and run without --chat (the server: /v1/completions)"
BROKEN = f"the model's template is broken; {WITHOUT_CHAT}"
CPU_SECONDS = 2
WALL_SECONDS = 10
# A rendering longer than this many characters per context token cannot fit the context (tokens average a few
# characters of text), so it is refused before tokenizing, which costs memory and time out of all proportion
MAX_CHARS_PER_TOKEN = 8


KEEP = 8  # idle rendering processes kept (the server renders on its --threads-http threads at once)
_idle: list[subprocess.Popen] = []
_lock = threading.Lock()


def render(source: str, variables: dict[str, Any], n_ctx: int | None = None) -> str:
    """The template's text for these variables (messages, add_generation_prompt, special tokens...); with n_ctx,
    refused once it passes MAX_CHARS_PER_TOKEN characters per token of that context."""
    if not isinstance(source, str):
        raise MoestreamError("the chat template (tokenizer.chat_template) is not text")
    reply = _ask(json.dumps({"source": source, "variables": variables, "n_ctx": n_ctx}))
    if "error" in reply:
        raise MoestreamError(f"chat template: {reply['error']}")
    return reply["text"]


def _ask(request: str) -> dict:
    """One rendering by an idle process (or a new one): its reply, or the error that stopped it."""
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None or worker.poll() is not None:
        worker = subprocess.Popen(
            [sys.executable, "-m", "moestream.formats.chat_template"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            encoding="utf-8",
        )
    line = ""
    try:
        worker.stdin.write(request + "\n")
        worker.stdin.flush()
        if not select.select([worker.stdout], [], [], WALL_SECONDS)[0]:
            _stop(worker)
            raise MoestreamError(f"chat template: rendering took more than {WALL_SECONDS} s; {WITHOUT_CHAT}")
        line = worker.stdout.readline()
        reply = json.loads(line)
    except (OSError, ValueError):  # it died: past a limit
        reply = {
            "error": f"rendering was stopped (exit {_stop(worker)}: past {MEMORY >> 30} GiB of memory or "
            f"{CPU_SECONDS} s of CPU); {BROKEN}"
        }
    else:
        with _lock:
            keep = "error" not in reply and len(_idle) < KEEP  # after an error its heap may be in any state
            if keep:
                _idle.append(worker)
        if not keep:
            _stop(worker)
    return reply


def _stop(worker: subprocess.Popen) -> int:
    """End a rendering process; its exit status."""
    worker.kill()
    for pipe in (worker.stdin, worker.stdout):
        try:
            pipe.close()
        except OSError:
            pass
    return worker.wait()


@atexit.register
def _stop_idle() -> None:
    with _lock:
        while _idle:
            _stop(_idle.pop())


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # as transformers compiles chat templates, so templates written for it render the same
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _rendered(template, variables: dict[str, Any], n_ctx: int | None) -> dict[str, str]:
    """{text}, or {error} as soon as the text passes the cap: rendered piece by piece, so never held whole."""
    if n_ctx is None:
        return {"text": template.render(**variables)}
    cap, pieces, n = MAX_CHARS_PER_TOKEN * n_ctx, [], 0
    for piece in template.generate(**variables):
        n += len(piece)
        if n > cap:
            return {
                "error": f"the conversation renders to more than {cap} characters, more than the {n_ctx}-token "
                f"context can hold ({MAX_CHARS_PER_TOKEN} a token); shorten the messages or raise --ctx"
            }
        pieces.append(piece)
    return {"text": "".join(pieces)}


def _child() -> None:
    """Read {source, variables, n_ctx} lines on stdin, write a {text} or {error} line on stdout for each, each
    rendering under the limits (the CPU limit counts from where the rendering starts)."""
    try:  # POSIX; elsewhere only the parent's wall-clock limit applies
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    except (ImportError, ValueError, OSError):
        resource = None
    import jinja2

    env, compiled = _environment(), {}
    for line in sys.stdin:
        if resource is not None:
            used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            try:
                resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(used) + CPU_SECONDS, hard))
            except (ValueError, OSError):
                pass
        request = json.loads(line)
        try:
            source = request["source"]
            if source not in compiled:
                compiled = {source: env.from_string(source)}  # one model's template a process, as a rule
            reply = _rendered(compiled[source], request["variables"], request.get("n_ctx"))
        except jinja2.TemplateSyntaxError as e:
            reply = {"error": f"does not compile: {str(e)[:160]}; {BROKEN}"}
        except MemoryError:
            reply = {"error": f"ran out of its {MEMORY >> 30} GiB of memory; {BROKEN}"}
        except RecursionError:
            reply = {"error": f"recursion too deep; {BROKEN}"}
        except Exception as e:  # template errors, and whatever the template's own code raises
            reply = {
                "error": f"{type(e).__name__}: {str(e)[:160]} (the model's template refused these messages); "
                f"{WITHOUT_CHAT}"
            }
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _child()
