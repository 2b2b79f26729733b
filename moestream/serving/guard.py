"""Who may use the server, and how much they may send: the API key on every route but /health (so /metrics,
/docs and /openapi.json too), compared in constant time, and the request size, checked before any endpoint runs.

The key comes from a file or the environment: a key on the command line is visible to every local user in `ps`.
"""

from __future__ import annotations

import hmac
import warnings
from collections.abc import Mapping
from pathlib import Path

from moestream.errors import MoestreamError
from moestream.serving.errors import error_response

ENV_KEY = "MOESTREAM_API_KEY"
OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe carries no key
MAX_BODY = 1 << 20  # bytes of a request


def api_key_of(key: str | None, key_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The key the server requires: --api-key-file's first line, else --api-key (with a warning), else
    $MOESTREAM_API_KEY; None serves without one."""
    if key is not None and key_file is not None:
        raise MoestreamError("--api-key and --api-key-file: give the key once")
    flag = "--api-key"
    if key_file is not None:
        flag = f"--api-key-file {key_file}"
        try:
            key = (Path(key_file).read_text(encoding="utf-8").splitlines() or [""])[0]
        except (OSError, UnicodeDecodeError) as e:
            raise MoestreamError(f"{flag}: {getattr(e, 'strerror', None) or e}; give a text file") from None
    elif key is not None:
        warnings.warn(
            f"--api-key is visible to every user of this machine (`ps`); use --api-key-file FILE or ${ENV_KEY}",
            stacklevel=2,
        )
    elif environ.get(ENV_KEY) is not None:
        key, flag = environ[ENV_KEY], f"${ENV_KEY}"
    if key is not None and not key.strip():
        raise MoestreamError(f"{flag} is empty: give a key, or none to serve without one")
    return key


class Guard:
    """ASGI middleware: the API key and the request size. Plain ASGI: FastAPI's @app.middleware("http") wraps
    `receive`, and then an endpoint never sees its client disconnect."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            refused = None
            if self.expected is not None and scope["path"] not in OPEN_PATHS:
                scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
                given = [headers.get(b"x-api-key", b"")]  # llama-server's other spelling
                given.append(bearer.strip() if scheme.lower() == b"bearer" else b"")  # the scheme in any case
                if not any([hmac.compare_digest(g, self.expected) for g in given]):  # both compared: no timing
                    refused = error_response(
                        401, "a valid API key is required (Authorization: Bearer KEY)", "authentication_error"
                    )
            length = headers.get(b"content-length", b"0")
            if refused is None and (not length.isdigit() or len(length) > 9 or int(length) > MAX_BODY):
                refused = error_response(413, f"the request is larger than {MAX_BODY} bytes")
            if refused is not None:  # the body is left unread: close the connection rather than read what follows
                refused.headers["connection"] = "close"
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)
