"""Secrets at rest: Fernet (AES-128-CBC + HMAC-SHA256) under keys from the environment.

FLYWHEEL_SECRETS_KEY holds one or more Fernet keys separated by commas: the first encrypts, all
decrypt (rotate by prepending a new key, re-saving, then dropping the old one). A database dump
alone then yields no usable webhook secret.
"""

from __future__ import annotations

from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings


class SecretUnreadable(RuntimeError):
    """A stored secret does not decrypt under FLYWHEEL_SECRETS_KEY (wrong or rotated-out key)."""


@lru_cache(maxsize=4)
def _box(keys: str) -> MultiFernet:
    return MultiFernet([Fernet(k.strip().encode()) for k in keys.split(",") if k.strip()])


def parse_keys(keys: str) -> None:
    """Raises ValueError unless `keys` is one or more valid Fernet keys separated by commas."""
    try:
        _box(keys)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a comma-separated list of Fernet keys ({exc})") from None


def encrypt(text: str) -> str:
    return _box(settings.FLYWHEEL_SECRETS_KEY).encrypt(text.encode()).decode()


def decrypt(token: str) -> str:
    try:
        return _box(settings.FLYWHEEL_SECRETS_KEY).decrypt(token.encode()).decode()
    except InvalidToken:
        raise SecretUnreadable("a stored secret does not decrypt under FLYWHEEL_SECRETS_KEY; "
                               "restore the key it was written with (or rotate the secret)") from None
