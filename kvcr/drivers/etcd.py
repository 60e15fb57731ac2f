"""etcd v3's JSON gateway (what Dynamo's discovery and kvcr's peer registry speak): one call, and
a range over a key prefix. Keys and values travel base64-encoded."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

TIMEOUT_S = 2.0


class EtcdError(OSError):
    pass


def b64(raw: str | bytes) -> str:
    return base64.b64encode(raw.encode() if isinstance(raw, str) else raw).decode()


def prefix_end(prefix: str) -> str:
    """etcd's range end for every key starting with `prefix` (its last byte plus one)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


def call(endpoint: str, path: str, body: dict, *, expect: str | None = None, timeout_s: float = TIMEOUT_S) -> dict:
    """POST `body` to the gateway; the answer, which must hold `expect` when named."""
    request = urllib.request.Request(endpoint.rstrip("/") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            # keepalive is a stream whose first line is our answer; the others are one message
            answer = json.loads(resp.readline() if path.endswith("keepalive") else resp.read())
    except urllib.error.HTTPError as exc:
        raise EtcdError(f"etcd at {endpoint}{path} answered {exc.code}"
                        f"{' (auth is on: kvcr sends no credentials)' if exc.code == 401 else ''}") from None
    except (OSError, ValueError) as exc:
        raise EtcdError(f"etcd at {endpoint}{path}: {exc}") from None
    if not isinstance(answer, dict) or (expect is not None and expect not in answer):
        raise EtcdError(f"etcd at {endpoint}{path}: no {expect!r} in its answer {str(answer)[:200]!r}")
    return answer


def range_prefix(endpoint: str, prefix: str, *, timeout_s: float = TIMEOUT_S) -> dict[str, bytes]:
    """key -> value of every key under `prefix`."""
    answer = call(endpoint, "/v3/kv/range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))},
                  timeout_s=timeout_s)
    out = {}
    for kv in answer.get("kvs", []):
        try:
            out[base64.b64decode(kv["key"]).decode(errors="replace")] = base64.b64decode(kv.get("value", ""))
        except (KeyError, ValueError, TypeError):
            continue  # not a key-value etcd would send
    return out
