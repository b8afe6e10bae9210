"""Named keys the operator gives, current first: how they are written (``id:key,id:key``) and how their ids look.

Response keys (``encryption.py``) and fingerprint keys (``fingerprint.py``) are both rotated the same way: the first
key is the one that writes, every key listed still reads, and each stored value names the id of the key it was made
under, so an id must never name another key later.
"""

from __future__ import annotations

import re

_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_key_id(kind: str, key_id: object) -> str:
    """``key_id`` if it is 1 to 64 characters of ``A-Z a-z 0-9 . _ -``, else ValueError naming ``kind``."""
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
        raise ValueError(f"{kind} id {key_id!r}: use 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-'")
    return key_id


def parse_keys(kind: str, text: str, example: str) -> list[tuple[str, str]]:
    """``id:key,id:key`` (commas or whitespace between them) as ``[(id, key), …]`` in order; ValueError that names
    the id (never the key) of an item written wrong. ``example`` shows one item written right."""
    pairs = []
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        key_id, colon, key = item.partition(":")
        if not colon or not key_id or not key:
            shown = key_id if colon else "(no 'id:' before it)"
            raise ValueError(f"{kind} {shown!r}: write each key as id:key, e.g. {example}")
        pairs.append((key_id, key))
    return pairs
