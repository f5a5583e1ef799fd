"""Session-id minting and process-stable sharding.

The router and every worker compute the owning shard of a session without talking to each
other, so the hash must not depend on ``PYTHONHASHSEED`` or the process: it is
``blake2b(session_id.encode(), digest_size=8)`` read as a big-endian integer, modulo the
number of shards.
"""

from __future__ import annotations

import hashlib
import uuid

__all__ = ["mint_session_id", "shard_for"]


def shard_for(session_id: str, n: int) -> int:
    """Return the shard (``0 <= shard < n``) that owns ``session_id``.

    Raises:
        ValueError: ``n`` is smaller than 1.
    """
    if n < 1:
        raise ValueError(f"number of shards must be >= 1, got {n}")
    digest = hashlib.blake2b(session_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % n


def mint_session_id(instance: str | None = None) -> str:
    """A fresh session id: 32 lowercase hex digits (uuid4), after ``INSTANCE-`` when this
    server is one instance of several behind nginx (webapp.scaleout: the tag routes it)."""
    return f"{instance}-{uuid.uuid4().hex}" if instance else uuid.uuid4().hex
