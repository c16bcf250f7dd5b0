"""POST /internal/push on the serving process's internal listener: a promotion's delta push.

The body is a push container (training/replicas/push.py) of any size the weights need; the
process that registered as a replica (`serve_policy`) sets `RECEIVER`, which verifies and swaps
(training/replicas/agent.py `ReplicaAgent.receive`) and answers what is served now. Authenticated
with FLYWHEEL_INTERNAL_TOKEN like /internal/load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from inference.apis import _handles_errors, _internal_auth
from inference.serving import ServingError

# Set by `serve_policy` once the process registered: (push body, ?project= slug or None) -> what
# is served now (a process serving several projects hands the push to that project's agent).
RECEIVER: Callable[[bytes, str | None], dict[str, Any]] | None = None


@csrf_exempt
@require_POST
@_handles_errors
def push(request: HttpRequest) -> JsonResponse:
    _internal_auth(request)
    if RECEIVER is None:
        raise ServingError(409, "this serving process is not a registered replica",
                           "Start it with `manage.py serve_policy --project SLUG` (not on --model-dir or "
                           "--policy-version), which registers it.")
    # read(), not .body: a push is as large as the weights it carries, above Django's form limit.
    return JsonResponse(RECEIVER(request.read(), request.GET.get("project")))
