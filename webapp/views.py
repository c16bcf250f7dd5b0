"""Dashboard pages."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from webapp import selectors


def healthz(request: HttpRequest) -> JsonResponse:
    with connection.cursor() as cur:
        cur.execute("SELECT 1")
    return JsonResponse({"ok": True})


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/overview.html", {"projects": selectors.project_overview()})
