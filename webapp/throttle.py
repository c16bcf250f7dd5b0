"""Password sign-in throttling for the dashboard and the admin: a small counter in the cache.

After LOGIN_FAILURES_MAX failed sign-ins for one account from one address, or from one address
for any accounts, within LOGIN_FAILURE_WINDOW_S, further attempts from that address are refused
without checking the password until the window (which starts at the first failure) ends.

Why not per account alone: a lock on the account would let anyone who knows a username lock its
owner out, from anywhere, for as long as they keep failing. Here a stranger's failures lock only
the stranger's address; the owner signing in from their own address is never refused for them.
What that costs: guessing one account's password from many addresses gets LOGIN_FAILURES_MAX
tries per address per window (password validators keep guessable passwords out); per address
stops trying one password on many accounts.

When Redis cannot be reached the counts are kept in this process's memory instead (logged): signing
in keeps working during an outage, and guessing stays throttled per process.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from django import forms
from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.core.cache.backends.base import BaseCache
from django.core.cache.backends.locmem import LocMemCache
from redis.exceptions import RedisError

from core.cache import shared_cache

log = logging.getLogger(__name__)
_LOCAL = LocMemCache("flywheel-login-failures", {"TIMEOUT": None, "OPTIONS": {"MAX_ENTRIES": 10_000}})


def _counted(op: Callable[[BaseCache], Any]) -> Any:
    """`op` on the shared cache, or on this process's memory while Redis is away."""
    try:
        return op(shared_cache())
    except (RedisError, OSError):
        log.warning("sign-in failures counted in this process only: Redis is unreachable", exc_info=True)
        return op(_LOCAL)


def _keys(request, username: str) -> list[str]:
    account = hashlib.sha256(username.strip().lower().encode()).hexdigest()[:32]
    address = request.META.get("REMOTE_ADDR", "") if request is not None else ""
    return [f"login-failures:account:{account}:address:{address}", f"login-failures:address:{address}"]


def login_locked(request, username: str) -> bool:
    counts = _counted(lambda store: store.get_many(_keys(request, username)))
    return any(count >= settings.LOGIN_FAILURES_MAX for count in counts.values())


def login_failed(request, username: str) -> None:
    for key in _keys(request, username):
        _counted(lambda store, key=key: _count(store, key))


def _count(store: BaseCache, key: str) -> None:
    if not store.add(key, 1, settings.LOGIN_FAILURE_WINDOW_S):
        try:
            store.incr(key)
        except ValueError:  # expired between add and incr
            store.add(key, 1, settings.LOGIN_FAILURE_WINDOW_S)


class _Throttled:
    def clean(self):
        username = self.data.get("username", "") or ""
        if login_locked(self.request, username):
            minutes = max(1, settings.LOGIN_FAILURE_WINDOW_S // 60)
            raise forms.ValidationError(
                f"Too many failed sign-ins from this address. Wait up to {minutes} minutes and try again, "
                "or ask an administrator to reset the password.", code="throttled")
        try:
            return super().clean()
        except forms.ValidationError:
            login_failed(self.request, username)
            raise


class ThrottledAuthenticationForm(_Throttled, AuthenticationForm):
    """The dashboard's sign-in form."""


class ThrottledAdminAuthenticationForm(_Throttled, AdminAuthenticationForm):
    """The admin's sign-in form."""
