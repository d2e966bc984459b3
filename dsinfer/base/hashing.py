"""Page hashes shared by the prefix cache and the gateway's cache-aware balancer.

Every FULL page of a token sequence gets a 16-byte key chained over everything before it::

    key_{-1} = root
    key_i    = blake2b(key_{i-1} || int64-LE tokens of page i, digest_size=16)

so a key names the whole prefix up to the end of its page, not just that page's tokens. The
root carries the model identity (see :func:`model_root`), so two models never share keys. Only
hashlib is used: keys are the same in every process and on every machine (never Python's
``hash()``, which is salted per process).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_SIZE = 16  # bytes per page key
_TOKEN_DTYPE = np.dtype("<i8")  # fixed width, fixed byte order: the same bytes on every host


def model_root(*parts: str | bytes) -> bytes:
    """Root key of one model and cache format, from any identifying parts.

    Pass everything that changes the cached values: model name or path, revision or weight
    checksum, KV dtype, page size (e.g. ``model_root("deepseek-v3", "rev1", "bfloat16", "64")``).
    Parts are length-prefixed, so ``("ab", "c")`` and ``("a", "bc")`` give different roots.
    """
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"dsinfer-root")
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else bytes(part)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def page_hash(prev: bytes, page_tokens: Sequence[int]) -> bytes:
    """Key of one page given the key before it (``root`` for the first page)."""
    h = hashlib.blake2b(prev, digest_size=DIGEST_SIZE)
    h.update(np.asarray(page_tokens, dtype=_TOKEN_DTYPE).tobytes())
    return h.digest()


def page_hashes(token_ids: Sequence[int], page_size: int, root: bytes) -> list[bytes]:
    """One chained key per full page of ``token_ids`` (a trailing partial page gets none).

    Chaining can be resumed: the keys of ``token_ids[k * page_size:]`` with ``root = keys[k - 1]``
    are ``keys[k:]``.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    num_full = len(token_ids) // page_size
    if num_full == 0:
        return []
    tokens = np.asarray(token_ids[: num_full * page_size], dtype=_TOKEN_DTYPE).reshape(num_full, page_size)
    keys: list[bytes] = []
    prev = root
    for row in tokens:
        h = hashlib.blake2b(prev, digest_size=DIGEST_SIZE)
        h.update(row.tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys
