"""What a request to the router must be: a JSON object body, and for operator routes the
operator's token; the client's credentials, passed on to workers as they came."""

from __future__ import annotations

import hmac
import json

from aiohttp import web

from kvcr.text import RequestError

from .config import RouterConfig


async def read_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def operator_refusal(cfg: RouterConfig, request: web.Request) -> str:
    """Why an operator-only request (a pinned target, the index view, membership) is refused; "" if allowed.
    Without router.operator_token only a router bound to loopback serves them."""
    token = cfg.operator_token
    if not token:
        return "" if cfg.host in ("127.0.0.1", "localhost", "::1") else \
            "this needs router.operator_token: the router is reachable from other hosts"
    given = request.headers.get("Authorization", "").encode()
    return "" if hmac.compare_digest(given, f"Bearer {token}".encode()) else \
        "this needs the operator token: Authorization: Bearer <router.operator_token>"


def client_auth(request: web.Request) -> dict[str, str]:
    """The client's credentials go to the worker as they came (SGLang's admin routes read them)."""
    return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
