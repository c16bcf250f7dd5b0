"""Dashboard pages: thin views over webapp.selectors; errors go through core.errors."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db import connection
from django.http import FileResponse, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST
from django.views.defaults import page_not_found

from core.errors import ApplicationError, Forbidden, html_error_response
from core.params import query_datetime, query_int, query_text
from training.corpora.selectors import corpus_rows
from training.replicas.selectors import replica_rows
from training.rewards import selectors as reward_selectors
from training.versions.selectors import policy_by_number, production_at
from webapp import charts, selectors, services, userdata
from webapp.rollouts import RolloutFilter, rollout_list, rollout_replay

View = Callable[..., HttpResponse]


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """handler404: under /api/ a JSON error in the API's one shape (an API client gets no HTML
    page, e.g. for /api/v1/versions/abc, whose id is not a number); elsewhere Django's page."""
    if not request.path.startswith("/api/"):
        return page_not_found(request, exception)
    body = {"error": {"code": "not_found", "message": f"no API operation answers {request.path[:200]!r}",
                      "fix": "Check the path against /api/docs/ (version ids are integers)."}}
    return JsonResponse(body, status=404)


def healthz(request: HttpRequest) -> JsonResponse:
    with connection.cursor() as cur:
        cur.execute("SELECT 1")
    return JsonResponse({"ok": True})


def plotly_js(request: HttpRequest) -> FileResponse:
    """Plotly's bundle from the installed `plotly` package: the dashboard needs no CDN."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    response = FileResponse(path.open("rb"), content_type="application/javascript")
    response["Cache-Control"] = "public, max-age=86400"
    return response


def page(view: View) -> View:
    """Login required (else redirect); a project page needs membership of that project (else the
    same 404 as a project that does not exist); errors as pages."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            if "slug" in kwargs:
                request.project, request.access = selectors.project_access(  # type: ignore[attr-defined]
                    request.user, kwargs["slug"])
            return view(request, *args, **kwargs)
        except ApplicationError as exc:
            return html_error_response(request, exc)

    return wrapper


def _ctx(request: HttpRequest, project: Any, tab: str, **extra: Any) -> dict[str, Any]:
    return {"project": project, "tab": tab, "access": request.access, **extra}  # type: ignore[attr-defined]


@page
def index(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/index.html", {"projects": selectors.project_list(request.user)})


@page
def overview(request: HttpRequest, slug: str) -> HttpResponse:
    project = request.project  # type: ignore[attr-defined]
    days = query_int(request.GET, "days", 14, 1, 90)
    charts = selectors.overview_charts(project, days)
    return render(request, "dashboard/overview.html", _ctx(
        request, project, "overview", days=days, totals=charts["totals"], figures=charts["figures"],
        versions=selectors.versions_live(project), active=selectors.run_active(project),
        accept=selectors.accept_by_version(project, days),
        queues=selectors.queue_depths(), errors=selectors.errors_recent(project)))


@page
def runs(request: HttpRequest, slug: str) -> HttpResponse:
    project = request.project  # type: ignore[attr-defined]
    run_list = selectors.run_list(project)
    run = selectors.run_get(project, query_int(request.GET, "run", None), run_list)
    compare_id = query_int(request.GET, "compare", None)
    compare = selectors.run_get(project, compare_id, run_list) if compare_id and run else None
    shown = [(r, selectors.run_curves(r)) for r in (run, compare) if r is not None]
    return render(request, "dashboard/runs.html", _ctx(
        request, project, "runs", runs=run_list, run=run, compare=compare,
        figures=charts.run_figures(shown) if shown else {}))


@page
def rubrics(request: HttpRequest, slug: str) -> HttpResponse:
    project = request.project  # type: ignore[attr-defined]
    task, tag = query_text(request.GET, "task"), query_text(request.GET, "tag")
    view = selectors.rubric_view(project, task, tag)
    figures = {**view["figures"], "strip": selectors.rubric_strip(project, task, tag)}
    return render(request, "dashboard/rubrics.html", _ctx(
        request, project, "rubrics", task=task, tag=tag, filters=selectors.rubric_filters(project),
        figures=figures, agreement=view["agreement"], judge_failures=view["judge_failures"],
        reward_models=selectors.reward_model_history(project),
        signals=reward_selectors.signal_rows(project)))


@page
def rollouts(request: HttpRequest, slug: str) -> HttpResponse:
    project = request.project  # type: ignore[attr-defined]
    flt = RolloutFilter.from_query(request.GET)
    return render(request, "dashboard/rollouts.html", _ctx(
        request, project, "rollouts", flt=flt, rollouts=rollout_list(project, flt),
        signals=[*selectors.POSITIVE, *selectors.NEGATIVE, "none"]))


@page
def replay(request: HttpRequest, slug: str, trajectory_id: int) -> HttpResponse:
    project = request.project  # type: ignore[attr-defined]
    flt = RolloutFilter.from_query(request.GET)
    data = rollout_replay(project, trajectory_id, flt)
    data["learned_by"] = userdata.replay_lineage(project, data["t"])
    figures = {"timeline": data["timeline"]}
    figures.update({f"routing-{s.step.index}": s.routing for s in data["steps"] if s.routing})
    return render(request, "dashboard/replay.html", _ctx(request, project, "rollouts", flt=flt, figures=figures, **data))


@page
def corpora(request: HttpRequest, slug: str) -> HttpResponse:
    project = request.project  # type: ignore[attr-defined]
    return render(request, "dashboard/corpora.html", _ctx(request, project, "corpora",
                                                          corpora=corpus_rows(project)))


@page
def registry(request: HttpRequest, slug: str) -> HttpResponse:
    project = request.project  # type: ignore[attr-defined]
    at = query_datetime(request.GET, "at")
    at_raw = request.GET.get("at", "") if at else ""
    return render(request, "dashboard/registry.html", _ctx(
        request, project, "registry", rows=selectors.registry(project), audit=selectors.audit_log(project),
        replicas=replica_rows(project), at=at_raw, live_at=production_at(project, at) if at else None, now=timezone.now(),
        lineage=userdata.registry_lineage(project)))


@page
def data(request: HttpRequest, slug: str) -> HttpResponse:
    project = request.project  # type: ignore[attr-defined]
    return render(request, "dashboard/data.html", _ctx(request, project, "data", **userdata.data_page(project)))


@require_POST
@page
def registry_action(request: HttpRequest, slug: str, number: int, action: str) -> HttpResponse:
    project = request.project  # type: ignore[attr-defined]
    if not request.access.can_approve:  # type: ignore[attr-defined]
        raise Forbidden(f"only approvers of {project.slug} can approve, reject or roll back its versions",
                        "Ask the project's admin for the approver role.")
    version = services.version_decide(policy_by_number(project, number), request.user, action,
                                      query_text(request.POST, "reason", 2000))
    messages.success(request, f"v{version.number}: {action} done, now {version.state}.")
    return redirect("registry", slug=project.slug)
