"""Named keys the operator gives, current first: how they are written (``id:key,id:key``) and how their ids look.

Response keys (``encryption.py``) and fingerprint keys (``fingerprint.py``) are both rotated the same way: the first
key is the one that writes, every key listed still reads, and each stored value names the id of the key it was made
under, so an id must never name another key later.
"""

from __future__ import annotations

import re

_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
# No key is this short (a response key is 43 characters or more, a fingerprint key 32), so text this short, given as
# an id, is shown in errors; longer text may be a key written where its id goes (``key:id``), and never is.
_SHOWN_ID_CHARACTERS = 31


def named(kind: str, key_id: object, position: int) -> str:
    """How an error names the key at ``position`` (1 for the first) of a list: by its id when that is short enough
    never to be a key, else by its place in the list."""
    if isinstance(key_id, str) and len(key_id) <= _SHOWN_ID_CHARACTERS:
        return f"{kind} {key_id!r}"
    return f"the {_ordinal(position)} {kind} (its id is not shown: it may be a key written before its id)"


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def check_key_id(kind: str, key_id: object, position: int) -> str:
    """``key_id`` if it is 1 to 64 characters of ``A-Z a-z 0-9 . _ -``, else ValueError naming the key by
    :func:`named`."""
    if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
        raise ValueError(
            f"{named(kind, key_id, position)}: an id is 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-'"
        )
    return key_id


def parse_keys(kind: str, text: str, example: str) -> list[tuple[str, str]]:
    """``id:key,id:key`` (commas or whitespace between them) as ``[(id, key), …]`` in order; ValueError that names
    an item written wrong by its id, or by its place when its id may be a key (:func:`named`), never by its key.
    ``example`` shows one item written right."""
    pairs: list[tuple[str, str]] = []
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        key_id, colon, key = item.partition(":")
        if not colon or not key_id or not key:
            shown = named(kind, key_id, len(pairs) + 1) if colon else f"the {_ordinal(len(pairs) + 1)} {kind}"
            raise ValueError(f"{shown}: write each key as id:key, e.g. {example}")
        pairs.append((key_id, key))
    return pairs
