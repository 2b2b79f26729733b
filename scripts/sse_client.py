"""Streamed requests to any OpenAI-compatible server (`moestream serve` or llama-server) with the standard library
only: the one client the serving benchmarks use against both engines."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator


class ServerError(Exception):
    """The server refused the request, answered an error, or could not be reached."""


def stream_events(url: str, path: str, body: dict, key: str | None = None, timeout: float = 3600) -> Iterator[dict]:
    """POST body to url + path with streaming on and usage asked for; yields each data chunk as parsed JSON."""
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(f"{url}{path}", json.dumps(body).encode(), headers)
    try:
        r = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise ServerError(f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ServerError(f"{url}: {getattr(e, 'reason', e)}; is the server running?") from None
    with r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise ServerError(f"error event: {chunk['error']}")
            yield chunk
