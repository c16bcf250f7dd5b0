"""Password sign-in throttling for the dashboard and the admin: a small counter in the cache.

After LOGIN_FAILURES_MAX failed sign-ins for one account, or from one address, within
LOGIN_FAILURE_WINDOW_S, further attempts are refused without checking the password until the
window (which starts at the first failure) ends. Counting per account stops guessing one
password from many addresses; per address stops trying one password on many accounts.
"""

from __future__ import annotations

import hashlib

from django import forms
from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.core.cache import cache


def _keys(request, username: str) -> list[str]:
    account = hashlib.sha256(username.strip().lower().encode()).hexdigest()[:32]
    address = request.META.get("REMOTE_ADDR", "") if request is not None else ""
    return [f"login-failures:account:{account}", f"login-failures:address:{address}"]


def login_locked(request, username: str) -> bool:
    counts = cache.get_many(_keys(request, username))
    return any(count >= settings.LOGIN_FAILURES_MAX for count in counts.values())


def login_failed(request, username: str) -> None:
    for key in _keys(request, username):
        if not cache.add(key, 1, settings.LOGIN_FAILURE_WINDOW_S):
            try:
                cache.incr(key)
            except ValueError:  # expired between add and incr
                cache.add(key, 1, settings.LOGIN_FAILURE_WINDOW_S)


class _Throttled:
    def clean(self):
        username = self.data.get("username", "") or ""
        if login_locked(self.request, username):
            minutes = max(1, settings.LOGIN_FAILURE_WINDOW_S // 60)
            raise forms.ValidationError(
                f"Too many failed sign-ins for this account or from this address. Wait up to {minutes} minutes "
                "and try again, or ask an administrator to reset the password.", code="throttled")
        try:
            return super().clean()
        except forms.ValidationError:
            login_failed(self.request, username)
            raise


class ThrottledAuthenticationForm(_Throttled, AuthenticationForm):
    """The dashboard's sign-in form."""


class ThrottledAdminAuthenticationForm(_Throttled, AdminAuthenticationForm):
    """The admin's sign-in form."""
