"""How the server fails: a JSON error for the client, never a traceback in the log.

Bodies it cannot use (JSON nested past the parser's recursion limit, strings with lone surrogates, which no
tokenizer takes) are a 400 naming the cause; a client that leaves mid-request is no error at all; anything else
unexpected is a JSON 500 and one log line.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

log = logging.getLogger("moestream.serving")


class ApiError(Exception):
    """An answer other than 200: status, a message naming the cause (and the fix), and OpenAI's error type."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object whose strings are valid Unicode, or a 400 saying why not."""
    try:
        body = json.loads(raw)
        # json.loads takes "\ud800" (a lone surrogate); UTF-8 cannot encode it, so the tokenizer would fail later
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ApiError(400, "the request body nests JSON too deeply; send a flat OpenAI request") from None
    except UnicodeEncodeError as e:
        raise ApiError(
            400,
            f"the request holds a lone surrogate (\\u{ord(e.object[e.start]):04x}), which is not Unicode text; "
            "send each character whole (a surrogate pair, or UTF-8)",
        ) from None
    except ValueError:
        raise ApiError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def one_line(e: BaseException) -> str:
    """The exception's type and the first line of its message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


class Errors:
    """ASGI middleware, outermost of the app's own: an exception no handler answered becomes a JSON 500 (when
    nothing was sent yet) and one log line; a client that went away mid-request ends it quietly. Starlette's own
    last handler sends text and re-raises, and the server then logs a traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except ClientDisconnect:
            pass  # the client left while its body was read: nobody to answer
        except Exception as e:
            answered = "the answer was cut short" if started else "answered 500"
            log.error("moestream: error: %s %s: %s (%s)", scope["method"], scope["path"], one_line(e), answered)
            if not started:
                response = error_response(500, f"internal error ({one_line(e)}); the server goes on", "server_error")
                await response(scope, receive, send)
