"""What /api/schema/ says beyond what drf-spectacular infers from the views (a postprocessing hook,
SPECTACULAR_SETTINGS["POSTPROCESSING_HOOKS"]):

- every error an operation can answer, in the one error shape of `core/errors.py`
  ({"error": {"code", "message", "fix", "fields"?}}), so a client (or a fuzzer) can check them;
- optional query parameters sent empty are the same as left out (`allowEmptyValue`);
- links between operations (the id a response names is the id the next call takes), which a
  stateful client follows: ingest → the trajectory it stored, the lists → one item, a version →
  its approve / reject / rollback.

tests/webapp/test_api_fuzz.py runs schemathesis against the result.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.hooks import postprocess_schema_enums

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["code", "message", "fix"],
        "properties": {
            "code": {"type": "string"},
            "message": {"type": "string", "description": "What was wrong."},
            "fix": {"type": "string", "description": "How to fix it."},
            "fields": {"description": "Per field: what was wrong with it (validation errors)."},
        },
    }},
}

_MEANING = {
    400: "The request is malformed; `error.fix` says how to correct it.",
    401: "No valid signature or API key.",
    403: "The key or account lacks the scope or permission.",
    404: "No such item in the caller's project.",
    406: "Not acceptable.",
    409: "The item's state does not allow the action.",
    413: "The body is over 5 MiB or 1,000 events.",
    415: "Send Content-Type: application/json.",
    429: "Over the project's rate; retry after Retry-After seconds.",
    503: "A store is away; retry later (nothing was half-written).",
}
_EVERYWHERE = (400, 401, 403, 404, 406, 503)
_EXTRA = {("/api/v1/events", "post"): (413, 415, 429)}
_ACTIONS = ("approve", "reject", "rollback")
for _action in _ACTIONS:
    _EXTRA[(f"/api/v1/versions/{{version_id}}/{_action}", "post")] = (409, 415, 429)  # 429: refusals rate-limited

_BODY_REQUIRED = [("/api/v1/events", "post"), *((f"/api/v1/versions/{{version_id}}/{a}", "post") for a in _ACTIONS)]
_BODY_REQUIRED += [("/api/v1/consent/opt-outs", "post"), ("/api/v1/erasures", "post")]
_EXTRA[("/api/v1/training-config", "put")] = (415,)  # JSON only
_BODY_REQUIRED += [("/api/v1/training-config", "put")]
# (path, method, status) -> link name -> (target path, target method, parameter, runtime expression)
_LINKS: dict[tuple[str, str, str], dict[str, tuple[str, str, str, str]]] = {
    ("/api/v1/events", "post", "202"): {
        "StoredTrajectory": ("/api/v1/trajectories/{external_id}", "get", "external_id", "$response.body#/results/0/id"),
    },
    ("/api/v1/trajectories", "get", "200"): {
        "FirstTrajectory": ("/api/v1/trajectories/{external_id}", "get", "external_id", "$response.body#/results/0/id"),
    },
    ("/api/v1/versions", "get", "200"): {
        "FirstVersion": ("/api/v1/versions/{version_id}", "get", "version_id", "$response.body#/results/0/id"),
        **{f"{a.title()}First": (f"/api/v1/versions/{{version_id}}/{a}", "post", "version_id",
                                 "$response.body#/results/0/id") for a in _ACTIONS},
    },
    ("/api/v1/versions/{version_id}", "get", "200"): {
        a.title(): (f"/api/v1/versions/{{version_id}}/{a}", "post", "version_id", "$response.body#/id") for a in _ACTIONS
    },
}


def postprocess(result: dict[str, Any], generator, request, public: bool) -> dict[str, Any]:
    result = postprocess_schema_enums(result, generator, request=request, public=public)
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR
    for path, operations in result.get("paths", {}).items():
        for method, operation in operations.items():
            _add_errors(operation, _EVERYWHERE + _EXTRA.get((path, method), ()))
            _empty_is_absent(operation)
    # A raw request schema leaves the body optional; these bodies are not.
    for path, method in _BODY_REQUIRED:
        body = result.get("paths", {}).get(path, {}).get(method, {}).get("requestBody")
        if body is not None:
            body["required"] = True
    _add_links(result)
    return result


def _add_errors(operation: dict[str, Any], statuses: tuple[int, ...]) -> None:
    responses = operation.setdefault("responses", {})
    for status in sorted(statuses):
        responses.setdefault(str(status), {
            "description": _MEANING[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        })


def _empty_is_absent(operation: dict[str, Any]) -> None:
    """DRF reads an optional query parameter sent empty (`?since=`) as one left out, as HTML
    forms do; the schema says so."""
    for parameter in operation.get("parameters", []):
        if parameter.get("in") == "query" and not parameter.get("required"):
            parameter["allowEmptyValue"] = True


def _add_links(result: dict[str, Any]) -> None:
    paths = result.get("paths", {})
    for (path, method, status), links in _LINKS.items():
        response = paths.get(path, {}).get(method, {}).get("responses", {}).get(status)
        if response is None:
            continue
        for name, (target, target_method, parameter, expression) in links.items():
            target_op = paths.get(target, {}).get(target_method)
            if target_op is not None:
                response.setdefault("links", {})[name] = {"operationId": target_op["operationId"],
                                                          "parameters": {parameter: expression}}
