"""A small blocking HTTP client (JSON in, status/headers/bytes out): the demo's driver and tests."""

from __future__ import annotations

import json
import urllib.error
import urllib.request


def http(url: str, body: dict | bytes | None = None, headers: dict | None = None, timeout_s: float = 120.0,
         method: str | None = None) -> tuple[int, dict, bytes]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def get_json(url: str, timeout_s: float = 10.0) -> dict:
    status, _, body = http(url, timeout_s=timeout_s)
    if status != 200:
        raise OSError(f"GET {url}: HTTP {status}: {body[:200]!r}")
    return json.loads(body)
