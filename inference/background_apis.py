"""The internal listener's background-rollout endpoints, and the middleware that counts live requests.

    PUT  /internal/rollouts/weights?id=ID&version=N   body: safetensors of the run's weights
    PUT  /internal/rollouts/weights?id=ID&version=N&encoding=delta   body: a kernels.delta blob
                               against the weights the replica holds (409 if it holds others)
    POST /internal/rollouts   {"weights": ID, "prompts": [[token ids]...], "n": G, "sampling": {...},
                               "deadline_s": 60, "first_index": 0}  -> when done: completions with their log-probs,
                               the weights id and version they came from, and the prompts returned
    GET  /internal/rollouts   what this replica holds and has sampled

Behind FLYWHEEL_INTERNAL_TOKEN (or the replica's own token), like /internal/push. The rule and
the engine are in inference/background.py; a replica started without --background-rollouts
answers 409 with how to turn it on.
"""

from __future__ import annotations

import asyncio
import queue
import time
from typing import Any

from asgiref.sync import markcoroutinefunction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_http_methods

from inference import background, serving
from inference.apis import _handles_errors, _internal_auth, _json_body, _number
from inference.engines import SamplingParams
from inference.serving import ServingError

MAX_PROMPTS = 1024
MAX_N = 64
MAX_DEADLINE_S = 3600.0


class LiveRequestsMiddleware:
    """Counts every live request (a POST under /v1/) in flight into `background.LIVE`, from its
    arrival to its answer: background rollouts step only while none is."""

    sync_capable, async_capable = False, True

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> Any:
        if request.method != "POST" or not request.path.startswith("/v1/"):
            return await self.get_response(request)
        with background.LIVE.request():
            return await self.get_response(request)


def _worker() -> background.BackgroundRollouts:
    if background.WORKER is None:
        raise ServingError(409, "this replica takes no background rollouts",
                           "Start it with `manage.py serve_policy --background-rollouts K` "
                           "(or FLYWHEEL_BACKGROUND_ROLLOUTS=K): at most K background sequences at once.")
    return background.WORKER


@csrf_exempt
@require_http_methods(["PUT"])
@_handles_errors
async def rollout_weights(request: HttpRequest) -> JsonResponse:
    _internal_auth(request)
    worker = _worker()
    weights, version = request.GET.get("id", ""), request.GET.get("version", "")
    encoding = request.GET.get("encoding", "safetensors")
    if not 0 < len(weights) <= 200 or not version.isdigit() or encoding not in ("safetensors", "delta"):
        raise ServingError(400, "the weights need an 'id' (1-200 characters), an integer 'version' and an "
                           f"'encoding' of safetensors or delta (got {encoding[:40]!r})",
                           "PUT /internal/rollouts/weights?id=run-7-round-0&version=3 with the safetensors body, "
                           "or &encoding=delta with a kernels.delta blob against the weights held.")
    data = request.read()  # read(), not .body: as large as the weights, above Django's form limit
    from kernels.delta import CheckpointCorrupt  # torch: the serving process has it loaded already

    try:
        await asyncio.to_thread(worker.put_weights, weights, int(version), data, encoding)
    except CheckpointCorrupt as exc:
        raise ServingError(409, f"the delta does not apply to the weights this replica holds "
                           f"({str(worker.weights)[:80]!r}): {str(exc)[:200]}",
                           "Send the whole weights (encoding=safetensors).") from None
    except Exception as exc:  # noqa: BLE001 - safetensors and load_state_dict raise several kinds
        raise ServingError(400, f"the weights do not load: {type(exc).__name__}: {str(exc)[:300]}",
                           "Send the whole model's state dict (HF names) as safetensors bytes "
                           "(safetensors.torch.save), of the served model's architecture.") from None
    return JsonResponse({"weights": weights, "version": int(version)})


@csrf_exempt
@require_http_methods(["GET", "POST"])
@_handles_errors
async def rollouts(request: HttpRequest) -> JsonResponse:
    _internal_auth(request)
    worker = _worker()
    if request.method == "GET":
        return JsonResponse(worker.status())
    job = _job(_json_body(request), worker)
    try:
        # Weights pushed by another run after this job was queued fail it the same way.
        return JsonResponse(await asyncio.wrap_future(worker.submit(job)))
    except background.UnknownWeights:
        raise ServingError(409, f"this replica does not hold weights {job.weights[:80]!r} (it holds "
                           f"{str(worker.weights)[:80]!r})", "PUT them to /internal/rollouts/weights first.") from None
    except queue.Full:
        raise ServingError(503, "this replica's background queue is full",
                           "Sample these prompts elsewhere (the run's own engine) or retry later.",
                           {"Retry-After": "5"}) from None


def _job(body: dict[str, Any], worker: background.BackgroundRollouts) -> background.RolloutJob:
    weights, prompts = body.get("weights"), body.get("prompts")
    if not isinstance(weights, str) or not weights:
        raise ServingError(400, "'weights' must name the weights pushed for this job", "Send {\"weights\": ID}.")
    limit = worker.max_model_len
    if not isinstance(prompts, list) or not 0 < len(prompts) <= MAX_PROMPTS or not all(
            isinstance(p, list) and 0 < len(p) < limit and all(type(t) is int and t >= 0 for t in p) for p in prompts):
        raise ServingError(400, f"'prompts' must be 1 to {MAX_PROMPTS} lists of token ids (non-negative integers), "
                           f"each shorter than {limit} tokens", "Send the prompts as the run's token ids.")
    sampling = body.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise ServingError(400, "'sampling' must be an object", "Send e.g. {\"max_tokens\": 16, \"seed\": 0}.")
    seed = sampling.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise ServingError(400, "'sampling.seed' must be an integer in [0, 2**63)", "Send a non-negative seed.")
    params = SamplingParams(
        max_tokens=_number(sampling, "max_tokens", 16, 1, serving.MAX_TOKENS, integer=True),
        temperature=float(_number(sampling, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(sampling, "top_p", 1.0, 1e-6, 1.0)),
        top_k=_number(sampling, "top_k", 0, 0, 1 << 20, integer=True), seed=seed)
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    deadline_s = float(_number(body, "deadline_s", 60.0, 0.0, MAX_DEADLINE_S))
    first = _number(body, "first_index", 0, 0, 1 << 30, integer=True)
    return background.RolloutJob(weights, prompts, n, params, deadline=time.monotonic() + deadline_s, first=first)
