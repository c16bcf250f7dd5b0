"""Who is calling: a bearer API key (with scopes) or a Standard Webhooks signature.

Both end in a `Principal` naming the project; DRF permission classes check scopes.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, NoReturn

from django.contrib.postgres.expressions import ArraySubquery
from django.db.models import DateTimeField, Exists, Func, OuterRef, Q
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from core import secretbox
from core.db import CompiledQuery
from core.errors import Forbidden, Unauthorized
from feedback.models import ApiKey, Membership, Project, WebhookSecret

WEBHOOK_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")
PROJECT_HEADER = "flywheel-project"
# Checked before standardwebhooks sees them: it raises ValueError (a 500) on a malformed
# signature list, and WebhookDelivery.webhook_id holds 255 characters.
_WEBHOOK_ID = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]{0,253}[\x21-\x7e])?")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
# A well-formed secret no project holds (made per process): what an unknown project is checked with.
_DECOY_SECRET = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
_SIGNATURE = re.compile(r"v[0-9]+[a-z]*,[A-Za-z0-9+/]+={0,2}")
SLUG = re.compile(r"[-a-zA-Z0-9_]{1,64}")  # Project.slug


@dataclass(frozen=True)
class Principal:
    """An authenticated API caller: a project and what it may do."""

    project: Project
    scopes: frozenset[str] = field(default_factory=frozenset)
    via: str = "api_key"  # or "webhook"
    name: str = "default"  # the key's name
    owner: Any = None  # the user (person or service account) the key acts as; None: nobody
    key_id: int | None = None

    is_authenticated = True

    def has_scope(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


def api_key_principal(raw: str) -> Principal:
    # A key bound to a person acts as that person in its project: one who left the project (no
    # membership any more) takes the key's power along. Read in the same query.
    member = Membership.objects.filter(user_id=OuterRef("owner_id"), project_id=OuterRef("project_id"))
    key = (ApiKey.objects.select_related("project", "project__data_policy", "owner").annotate(owner_is_member=Exists(member))
           .filter(key_hash=ApiKey.hash_key(raw)).first())
    if key is None:
        raise Unauthorized("the API key is not known", "Check the key; create one with `manage.py create_project`.")
    if key.revoked_at is not None:
        raise Unauthorized("the API key was revoked", "Use a current key of this project.")
    if key.owner is not None and not key.owner.is_active:
        raise Unauthorized(f"the API key acts as {key.owner.get_username()!r}, whose account is deactivated",
                           "Use a key of an active account (manage.py create_key --owner USERNAME).")
    if key.owner is not None and not key.owner_is_member:
        raise Unauthorized(f"the API key acts as {key.owner.get_username()!r}, who is no member of project "
                           f"{key.project.slug!r} any more",
                           "Use a key of a current member (manage.py create_key --owner USERNAME), or grant the "
                           "account a role in the project again (manage.py member).")
    return Principal(project=key.project, scopes=frozenset(key.scopes), via="api_key", name=key.name,
                     owner=key.owner, key_id=key.pk)


def bearer_token(authorization: str) -> str | None:
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeyAuthentication(BaseAuthentication):
    """DRF authentication for `Authorization: Bearer fw_…`."""

    def authenticate(self, request):
        token = bearer_token(request.headers.get("authorization", ""))
        if token is None:
            return None
        principal = api_key_principal(token)
        return principal, principal

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="flywheel"'


class ApiKeySchema(OpenApiAuthenticationExtension):
    """How the API docs describe ApiKeyAuthentication (registered by being defined)."""

    target_class = "feedback.auth.ApiKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "An API key (fw_...) with the scopes the call needs."}


def _scope_permission(scope: str) -> type[BasePermission]:
    class HasScope(BasePermission):
        def has_permission(self, request, view) -> bool:
            principal = request.user
            if isinstance(principal, Principal):
                if not principal.has_scope(scope):
                    raise Forbidden(
                        f"this API key lacks the '{scope}' scope",
                        f"Create a key with scope '{scope}' (manage.py create_key --scopes {scope}).",
                    )
                return True
            # A session: which projects it may read is decided where the project is resolved
            # (feedback.selectors.project_for_member: a project it is no member of is a 404).
            return bool(principal and principal.is_authenticated and principal.is_active)

    HasScope.__name__ = f"HasScope_{scope}"
    return HasScope


HasIngestScope = _scope_permission("ingest")
HasReadScope = _scope_permission("read")
HasAdminScope = _scope_permission("admin")


def webhook_principal(project_slug: str | None, body: str, headers: dict[str, str]) -> Principal:
    """Verifies a Standard Webhooks signature (±5 min) against the project's active secrets.

    `body` is the request body decoded as UTF-8: what the sender signed."""
    missing = [h for h in WEBHOOK_HEADERS if not headers.get(h)]
    if missing:
        raise Unauthorized(
            f"missing signature headers {missing}",
            "Sign with Standard Webhooks: send webhook-id, webhook-timestamp and webhook-signature.",
        )
    signed = {h: headers[h] for h in WEBHOOK_HEADERS}
    _check_webhook_headers(signed)
    project = _signing_project(project_slug)
    # An unknown project, or one with no active secret, is checked against a secret nobody has:
    # its answer is the one a wrong signature for a real project gets (no oracle for slugs).
    candidates = (_active_secrets(project) if project is not None else []) or [_DECOY_SECRET]
    last_error = "no matching signature"
    for secret in candidates:
        try:
            Webhook(secret).verify(body, signed, json_parse=False)
            if project is not None and secret is not _DECOY_SECRET:
                return Principal(project=project, scopes=frozenset({"ingest"}), via="webhook")
        except WebhookVerificationError as exc:
            last_error = str(exc)
            if "timestamp" in last_error.lower():
                break
        except (ValueError, TypeError):  # a header shape _check_webhook_headers let through
            _malformed("webhook-signature", signed["webhook-signature"])
    raise Unauthorized(_signature_message(last_error), _signature_fix(last_error))


def _check_webhook_headers(signed: dict[str, str]) -> None:
    if not _WEBHOOK_ID.fullmatch(signed["webhook-id"]):
        raise Unauthorized(f"webhook-id {_shown(signed['webhook-id'])} is malformed",
                           "Send a unique id per delivery of 1 to 255 printable ASCII characters, such as msg_<uuid>.")
    if not _TIMESTAMP.fullmatch(signed["webhook-timestamp"]):
        raise Unauthorized(f"webhook-timestamp {_shown(signed['webhook-timestamp'])} is not a Unix time",
                           "Send the signing time as whole seconds since 1970-01-01 UTC, e.g. 1764489600.")
    versions = signed["webhook-signature"].split(" ")
    if not all(_SIGNATURE.fullmatch(v) and (not v.startswith("v1,") or _is_base64(v[3:])) for v in versions):
        _malformed("webhook-signature", signed["webhook-signature"])


def _malformed(header: str, value: str) -> NoReturn:
    raise Unauthorized(
        f"{header} {_shown(value)} is malformed",
        "Send 'v1,<base64 of HMAC-SHA256 over \"{webhook-id}.{webhook-timestamp}.{body}\">' (several "
        "signatures separated by single spaces), as Standard Webhooks libraries do.",
    )


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except binascii.Error:
        return False
    return True


def _signing_project(slug: str | None) -> Project | None:
    """The project named by a signed request, with its data policy (ingest reads it next:
    feedback.services.data_policy_of) and its active secrets (`_active_secrets`) in one query."""
    if not slug:
        raise Unauthorized(
            "signed request does not name its project",
            f"Send the header '{PROJECT_HEADER}: <project slug>' (or ?project=<slug>) with signed requests.",
        )
    if not SLUG.fullmatch(slug):
        return None
    return _SIGNING_PROJECT.get(slug=slug)


def _signing_project_query(slug: str) -> Any:
    return (Project.objects.select_related("data_policy")
            .annotate(active_secrets_encrypted=ArraySubquery(_active(OuterRef("pk")).values("secret_encrypted")[:2]))
            .filter(slug=slug))


# Compiled once per thread: the ORM's compile of this query cost 0.64 ms of a signed request's CPU.
_SIGNING_PROJECT = CompiledQuery(_signing_project_query, slug="\x00slug")


def _shown(value: str) -> str:
    return repr(value) if len(value) <= 60 else repr(value[:57]) + "..."


def _active(project: Any) -> Any:
    """The project's secrets that verify now, newest first (two during a rotation's grace)."""
    return (WebhookSecret.objects.filter(project=project, revoked_at__isnull=True)
            .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=StatementTime())).order_by("-created_at"))


class StatementTime(Func):
    """The database's clock when the statement began (not the transaction's start, as now()
    is): a compiled query reads the time it runs at."""

    template = "statement_timestamp()"
    output_field = DateTimeField()


def _active_secrets(project: Project) -> list[str]:
    encrypted = getattr(project, "active_secrets_encrypted", None)  # fetched with the project
    if encrypted is None:
        encrypted = list(_active(project).values_list("secret_encrypted", flat=True)[:2])
    return [secretbox.decrypt(e) for e in encrypted]


def _signature_message(error: str) -> str:
    lower = error.lower()
    if "too old" in lower:
        return "webhook-timestamp is more than 5 minutes in the past"
    if "too new" in lower:
        return "webhook-timestamp is more than 5 minutes in the future"
    if "header" in lower:
        return "the signature headers are malformed"
    return "the webhook signature does not match the body"


def _signature_fix(error: str) -> str:
    if "too" in error.lower():
        return "Sign each delivery at send time with the current Unix time; check the sender's clock."
    return (f"Sign exactly the bytes you send, with the current whsec_ secret of the project named in {PROJECT_HEADER} "
            "(HMAC-SHA256 of id.timestamp.body); check the slug as shown in the dashboard.")
