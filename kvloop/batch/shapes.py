"""OpenAI's Batch API objects as plain dicts (the SDK's `FileObject`, `Batch`, list pages,
and the lines of output and error files), their ids, and who owns them.

An owner is a digest of the API key presented (`Authorization: Bearer KEY` or `x-api-key`),
never the key: a file or batch is found only with the key that created it; another key,
or none, gets 404, as for an id that does not exist.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping
from typing import Any

from kvloop.front.auth import bearer_token, presented_authorization

FILE_PREFIX, BATCH_PREFIX, LINE_PREFIX = "file-", "batch_", "batch_req_"
_ID = re.compile(r"^(file-|batch_)[0-9a-f]{24}$")
BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired",
                  "cancelling", "cancelled")
TERMINAL = frozenset({"failed", "completed", "expired", "cancelled"})
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def valid_id(value: str, prefix: str) -> bool:
    """Is `value` an id this store could have made (never a path, never too long)?"""
    return value.startswith(prefix) and _ID.match(value) is not None


def owner_of(headers: Mapping[str, str]) -> str:
    """The digest of the key a request presents ('' digest: none)."""
    key = bearer_token(presented_authorization(headers)) or ""
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"kvloop-batch").hexdigest()


def file_object(fid: str, size: int, created_at: int, filename: str, purpose: str
                ) -> dict[str, Any]:
    return {"id": fid, "object": "file", "bytes": size, "created_at": created_at,
            "filename": filename, "purpose": purpose, "status": "processed",
            "expires_at": None, "status_details": None}


def batch_object(bid: str, input_file_id: str, endpoint: str, window: str, created_at: int,
                 expires_at: int, metadata: dict[str, str] | None) -> dict[str, Any]:
    return {"id": bid, "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_file_id, "completion_window": window,
            "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": created_at, "in_progress_at": None, "expires_at": expires_at,
            "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata, "model": None}


def public(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object as a client sees it (the store's own fields, `_`-prefixed, left out)."""
    return {k: v for k, v in obj.items() if not k.startswith("_")}


def page(items: list[dict[str, Any]], limit: int, after: str | None) -> dict[str, Any]:
    """OpenAI's cursor page of `items` (already newest first): those after `after`."""
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    data = [public(i) for i in items[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


def output_line(custom_id: str | None, status: int, request_id: str, body: Any
                ) -> dict[str, Any]:
    """One line of an output (2xx) or error (other status) file: the endpoint's answer."""
    return {"id": new_id(LINE_PREFIX), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


def error_line(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """One line of an error file for a request that never reached an endpoint."""
    return {"id": new_id(LINE_PREFIX), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def succeeded(line: Mapping[str, Any]) -> bool:
    response = line.get("response")
    return isinstance(response, dict) and 200 <= response.get("status_code", 0) < 300


def check_metadata(value: Any) -> str | None:
    """What is wrong with a batch's `metadata` (None: nothing): OpenAI's bounds."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        return f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs"
    for k, v in value.items():
        if not isinstance(v, str) or len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            return (f"metadata keys have at most {MAX_METADATA_KEY} characters and values "
                    f"are strings of at most {MAX_METADATA_VALUE}")
    return None
