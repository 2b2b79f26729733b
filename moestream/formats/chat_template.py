"""Render a model file's chat template, in a child process with hard limits.

A chat template is code that comes with the model file. Rendered in the sandbox transformers uses, it cannot
touch the system, but it can loop without end or build a string of any size in one call (`'a'.ljust(10**12)`,
a `replace` in a loop...). So it runs in a fresh Python process (only jinja2 imported, ~60 ms) capped at
1 GiB of address space and 2 s of CPU; whatever goes wrong comes back as one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
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


def render(source: str, variables: dict[str, Any], n_ctx: int | None = None) -> str:
    """The template's text for these variables (messages, add_generation_prompt, special tokens...); with n_ctx,
    refused once it passes MAX_CHARS_PER_TOKEN characters per token of that context."""
    if not isinstance(source, str):
        raise MoestreamError("the chat template (tokenizer.chat_template) is not text")
    request = json.dumps({"source": source, "variables": variables, "n_ctx": n_ctx})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "moestream.formats.chat_template"],
            input=request,
            capture_output=True,
            text=True,
            timeout=WALL_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise MoestreamError(f"chat template: rendering took more than {WALL_SECONDS} s; {WITHOUT_CHAT}") from None
    try:
        reply = json.loads(done.stdout)
    except ValueError:
        reply = {
            "error": f"rendering was stopped (exit {done.returncode}: past {MEMORY >> 30} GiB of memory or "
            f"{CPU_SECONDS} s of CPU); {BROKEN}"
        }
    if "error" in reply:
        raise MoestreamError(f"chat template: {reply['error']}")
    return reply["text"]


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
    """Read {source, variables} on stdin, write {text} or {error} on stdout, under the limits."""
    try:  # POSIX; elsewhere only the parent's wall-clock limit applies
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
        resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS + 1))
    except (ImportError, ValueError, OSError):
        pass
    request = json.load(sys.stdin)
    try:
        import jinja2

        try:
            template = _environment().from_string(request["source"])
        except jinja2.TemplateError as e:
            reply = {"error": f"does not compile: {str(e)[:160]}; {BROKEN}"}
        else:
            reply = _rendered(template, request["variables"], request.get("n_ctx"))
    except MemoryError:
        reply = {"error": f"ran out of its {MEMORY >> 30} GiB of memory; {BROKEN}"}
    except RecursionError:
        reply = {"error": f"recursion too deep; {BROKEN}"}
    except Exception as e:  # template errors, and whatever the template's own code raises
        reply = {
            "error": f"{type(e).__name__}: {str(e)[:160]} (the model's template refused these messages); {WITHOUT_CHAT}"
        }
    sys.stdout.write(json.dumps(reply))


if __name__ == "__main__":
    _child()
