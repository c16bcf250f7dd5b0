"""HTTP endpoints of the serving process (OpenAI subset + internal weight loading).

Two listeners, served by `manage.py serve_policy`: the public one (inference/urls.py: /v1/* with a
bearer key of scope `serve` of the served project) and the internal one on loopback
(inference/internal_urls.py: /internal/load with FLYWHEEL_INTERNAL_TOKEN). Errors use the OpenAI
shape {"error": {"message", "type", "code", "fix"}}, which the `openai` client raises as APIError.
Every bound (body size, prompt characters, messages, n, max_tokens) is checked before the prompt
reaches the tokenizer. The completion views are async: concurrent requests wait on the engine
together (see PolicyServer.acomplete) instead of queueing for Django's one sync thread.
"""

from __future__ import annotations

import hmac
import json
import math
import re
import time
import uuid
from typing import Any

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from core.db import keep_connections
from core.errors import ApplicationError
from core.metrics import metrics_response
from feedback.auth import Principal, api_key_principal, bearer_token
from feedback.models import ApiKey
from feedback.ratelimit import serving_admitted_here, serving_rate_check
from inference import conversations, metrics, serving, tools
from inference.engines import SamplingParams
from inference.serving import CompletionRequest, Served, ServingError

_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")  # what ingest refuses in a user id

VERSION_HEADER = "Flywheel-Policy-Version"
MAX_BODY_BYTES = 1024 * 1024
# A key checked once is trusted this long: a revocation reaches the serving process within it
# (the request path then skips a database round trip).
KEY_CACHE_S = 10.0
_keys: dict[str, tuple[float, Principal]] = {}


def _error(exc: ApplicationError) -> JsonResponse:
    """The one error family (core/problems.py) in the shape OpenAI clients read: a refusal raised
    anywhere below (a key, a rate limit, the engine) answers the same way."""
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    body = {"error": {"message": exc.message, "type": kind, "code": exc.status_code, "fix": exc.fix}}
    response = JsonResponse(body, status=exc.status_code)
    for name, value in exc.headers.items():
        response[name] = value
    return response


def _handles_errors(view):
    if iscoroutinefunction(view):
        async def awrapped(request: HttpRequest, *args, **kwargs):
            try:
                return await view(request, *args, **kwargs)
            except ApplicationError as exc:
                return _error(exc)

        awrapped.__name__ = view.__name__
        return awrapped

    def wrapped(request: HttpRequest, *args, **kwargs):
        try:
            return view(request, *args, **kwargs)
        except ApplicationError as exc:
            return _error(exc)

    wrapped.__name__ = view.__name__
    return wrapped


def _json_body(request: HttpRequest) -> dict[str, Any]:
    declared = request.META.get("CONTENT_LENGTH") or "0"
    if not declared.isdigit() or int(declared) > MAX_BODY_BYTES:
        raise _too_big()
    try:
        raw = request.body
    except RequestDataTooBig:
        raise _too_big() from None
    if len(raw) > MAX_BODY_BYTES:
        raise _too_big()
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        raise ServingError(400, "the body is not valid JSON", "Send a JSON object.") from None
    if not isinstance(body, dict):
        raise ServingError(400, "the body must be a JSON object", "Send {\"model\": ..., ...}.")
    return body


def _too_big() -> ServingError:
    return ServingError(413, f"the body is over {MAX_BODY_BYTES} bytes",
                        "Send a shorter prompt: it must fit the model's context anyway.")


def _serve_auth(request: HttpRequest) -> tuple[Principal, serving.PolicyServer]:
    """The caller's key (scope `serve`, or admin) and the server of its project, among those this
    process serves: a request only ever reaches its own project's versions (and adapters). A
    process with no policy loaded says so first (503, as /healthz does): no key could be checked yet."""
    serving.current()
    return _authorised(_principal(_token(request)))


async def _aserve_auth(request: HttpRequest) -> tuple[Principal, serving.PolicyServer]:
    """`_serve_auth` for async views: a key not in the cache is looked up on Django's sync thread."""
    serving.current()
    token = _token(request)
    principal = _cached_principal(token) or await sync_to_async(_principal)(token)
    return _authorised(principal)


def _token(request: HttpRequest) -> str:
    token = bearer_token(request.headers.get("authorization", ""))
    if token is None:
        raise ServingError(401, "no API key was sent",
                           "Send 'Authorization: Bearer fw_...' with a key of scope 'serve' "
                           "(manage.py create_key SLUG --scopes serve).")
    return token


def _authorised(principal: Principal) -> tuple[Principal, serving.PolicyServer]:
    if principal.project.slug not in serving.servers():
        raise ServingError(403, "this key belongs to another project than the ones this process serves",
                           "Use a key of a project this serving process serves (GET /v1/models names its "
                           "models), or send the request to that project's serving process.")
    if not principal.has_scope("serve"):
        raise ServingError(403, "this API key lacks the 'serve' scope",
                           "Create a key with scope 'serve' (manage.py create_key SLUG --scopes serve).")
    return principal, serving.current(principal.project.slug)


def _cached_principal(token: str) -> Principal | None:
    cached = _keys.get(ApiKey.hash_key(token))
    return cached[1] if cached is not None and cached[0] > time.monotonic() else None


def _principal(token: str) -> Principal:
    digest, now = ApiKey.hash_key(token), time.monotonic()
    cached = _keys.get(digest)
    if cached is not None and cached[0] > now:
        return cached[1]
    # On Django's sync thread (inference/listeners.py): its connection is kept between look-ups.
    keep_connections()
    principal = api_key_principal(token)  # a refused key: the family's 401/403, answered as it is
    if len(_keys) > 10_000:
        _keys.clear()
    _keys[digest] = (now + KEY_CACHE_S, principal)
    return principal


def _check_prompt_size(texts: list[str], server: serving.PolicyServer) -> None:
    limit = server.max_prompt_chars()
    size = sum(len(t) for t in texts)
    if size > limit:
        raise ServingError(400, f"the prompt is {size} characters; this model's context holds at most {limit}",
                           "Shorten the prompt (keep the end that matters) or split the request.")


def _number(body: dict, name: str, default: float, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(name, default)
    if value is None:
        value = default
    ok_type = type(value) is int if integer else isinstance(value, int | float) and not isinstance(value, bool)
    # Compared before any float conversion: a 400-digit integer overflows float().
    if not ok_type or (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ServingError(400, f"'{name}' must be {kind} in [{low}, {high}], got {repr(value)[:40]}",
                           f"Send {name} between {low} and {high}.")
    return value


def _sampling(body: dict) -> SamplingParams:
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or len(stop) > 4 or not all(isinstance(s, str) and 0 < len(s) <= 64 for s in stop):
        raise ServingError(400, "'stop' must be a string or a list of at most 4 strings of 1 to 64 characters",
                           "Fix 'stop'.")
    seed = body.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise ServingError(400, "'seed' must be an integer in [0, 2**63)", "Send a non-negative 64-bit seed or none.")
    return SamplingParams(
        max_tokens=_number(body, "max_tokens", 64, 1, serving.MAX_TOKENS, integer=True),
        temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
        top_p=float(_number(body, "top_p", 1.0, 1e-6, 1.0)),
        seed=seed, stop=tuple(stop),
    )


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ServingError(400, "'model' is missing", "Name a model from GET /v1/models.")
    return model


def _check_messages_size(messages: list[dict[str, Any]], offered: list[dict[str, Any]],
                         server: serving.PolicyServer) -> None:
    """The messages the engine will read (a compacted conversation's: its prompt and the messages
    since its summary) within the message and prompt bounds."""
    conversations.check_read_size(messages)
    calls = [json.dumps(m["tool_calls"]) for m in messages if m.get("tool_calls")]
    _check_prompt_size([m["content"] for m in messages] + calls + ([json.dumps(offered)] if offered else []), server)


def _task(body: dict) -> str:
    metadata = body.get("metadata") or {}
    task = metadata.get("task", "chat") if isinstance(metadata, dict) else "chat"
    return task if isinstance(task, str) and len(task) <= 100 else "chat"


def _user(body: dict) -> str | None:
    user = body.get("user")
    if user is None or (isinstance(user, str) and 0 < len(user) <= 255 and not _BAD_TEXT.search(user)):
        return user or None
    raise ServingError(400, "'user' must be a string of 1 to 255 characters (valid Unicode, no NUL)",
                       "Send your product's id of the person the completion is for (it is stored hashed), or leave it out.")


def _respond(served: Served, payload: dict[str, Any]) -> JsonResponse:
    response = JsonResponse(payload)
    response[VERSION_HEADER] = str(served.version)
    return response


def _usage(request: CompletionRequest, served: Served) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in served.completions)
    return {"prompt_tokens": len(request.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(request.prompt_ids) + completion}


async def _serve(server: serving.PolicyServer, body: dict[str, Any], messages: list[dict[str, Any]], encode,
                 want_logprobs: bool, linked: conversations.Link | None = None, **hooks: Any):
    """Checks every bound, picks the engine once (a canary draw included), then tokenises with
    it (a conversation over the summary budget is first compacted on it: inference/conversations.py),
    generates (sharing the engine's batches with the other requests in flight), records."""
    model = _model(body)
    n, sampling, task = _number(body, "n", 1, 1, serving.MAX_N, integer=True), _sampling(body), _task(body)
    engine = server.pick_engine(model)
    if linked is not None:
        messages = await linked.prepare(server, engine, model, sampling, encode)
    req = CompletionRequest(model, encode(engine, messages), messages, n, sampling, want_logprobs, task,
                            user=_user(body), **hooks)
    return server, engine, req, await server.acomplete(req, engine)


def _envelope(server, req: CompletionRequest, served: Served, chat: bool, choices: list, **more: Any) -> JsonResponse:
    prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    return _respond(served, {
        "id": served.trajectory_ids[0] if req.n == 1 else f"{prefix}-{uuid.uuid4().hex}",
        "object": kind, "created": int(time.time()), "model": server.model_name(served.version),
        "choices": choices, "usage": _usage(req, served), **more,
    })


def _pairs(served: Served):
    return enumerate(zip(served.completions, served.trajectory_ids, strict=True))


RECORDER_RETRY_S = 5


async def _admit(principal: Principal, body: dict[str, Any], server: serving.PolicyServer) -> None:
    """Before anything is generated or a conversation slot is taken: room in the recorder (a
    completion it cannot hold is refused, not answered and lost), then the rate limits per key
    and per project, and the ingest rate the recorded completions count against (Redis, shared
    by the replicas, waited on only near a limit: feedback/ratelimit.py)."""
    n = _number(body, "n", 1, 1, serving.MAX_N, integer=True)
    recorder = server.recorder
    if recorder is not None and recorder.full():
        metrics.RECORDER_SHED.labels("refused").inc()
        raise ServingError(503, "this serving process is behind on recording completions",
                           f"Retry after {RECORDER_RETRY_S} s (Retry-After); the store is slow or away.",
                           headers={"Retry-After": str(RECORDER_RETRY_S)})
    if serving_admitted_here(principal.project, principal.key_id, n):
        return  # far from every limit: counted here, settled with Redis in the background
    # Off the event loop (a Redis round trip), on no particular thread; RateLimited is a 429 as it is.
    await sync_to_async(serving_rate_check, thread_sensitive=False)(principal.project, principal.key_id, n)


@csrf_exempt
@require_POST
@_handles_errors
async def chat_completions(request: HttpRequest) -> JsonResponse:
    principal, server = await _aserve_auth(request)
    body = _json_body(request)
    offered = tools.tools_of(body)
    messages = tools.messages_of(body.get("messages"), serving.MAX_HISTORY)
    await _admit(principal, body, server)
    linked = conversations.link(server, body, messages, principal.key_id)
    _check_messages_size(linked.read() if linked else messages, offered, server)
    server, engine, req, served = await _serve(server, body, messages, lambda e, m: list(e.tokenizer.apply_chat_template(
        m, tools=offered or None, add_generation_prompt=True, tokenize=True, return_dict=False)),
        bool(body.get("logprobs")), linked, step_fields=tools.recorded_fields(offered),
        record=linked and linked.record)
    answers = [tools.answer_of(offered, c.text, c.finish_reason, tid) for c, tid in zip(served.completions, served.trajectory_ids, strict=True)]
    choices = [{
        "index": i, "message": {"role": "assistant", "content": a.content,
                                **({"tool_calls": a.tool_calls} if a.tool_calls else {})},
        "finish_reason": a.finish_reason,
        "logprobs": {"content": [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip(serving.token_texts(engine.tokenizer, c.token_ids), c.logprobs, strict=True)
        ]} if req.want_logprobs else None,
        "trajectory_id": linked.trajectory_id if linked else tid,
    } for (i, (c, tid)), a in zip(_pairs(served), answers, strict=True)]
    extension = linked.extension() if linked else {}
    return _envelope(server, req, served, True, choices,
                     **({"conversation_id": linked.conversation.key} if linked else {}),
                     **({"flywheel": extension} if extension else {}))


@csrf_exempt
@require_POST
@_handles_errors
async def completions(request: HttpRequest) -> JsonResponse:
    principal, server = await _aserve_auth(request)
    body = _json_body(request)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ServingError(400, "'prompt' must be a non-empty string", "Send the text to continue.")
    _check_prompt_size([prompt], server)
    await _admit(principal, body, server)
    logprobs = body.get("logprobs")
    server, engine, req, served = await _serve(server, body, [{"role": "user", "content": prompt}], lambda e, _: e.encode(prompt),
                                         logprobs is not None and logprobs is not False)
    choices = [{
        "index": i, "text": c.text, "finish_reason": c.finish_reason, "trajectory_id": tid,
        "logprobs": {"tokens": serving.token_texts(engine.tokenizer, c.token_ids), "token_logprobs": c.logprobs,
                     "top_logprobs": None, "text_offset": None} if req.want_logprobs else None,
    } for i, (c, tid) in _pairs(served)]
    return _envelope(server, req, served, False, choices)


@require_GET
@_handles_errors
def models(request: HttpRequest) -> JsonResponse:
    _, server = _serve_auth(request)
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "flywheel"} for name in server.model_names()]
    return JsonResponse({"object": "list", "data": data})


@csrf_exempt
@require_POST
@_handles_errors
async def load_version(request: HttpRequest) -> JsonResponse:
    """Internal: {"version": N} (production) or {"canary": N, "share": 0.1} / {"canary": null};
    "project": SLUG names the project in a process that serves several (default: its first).
    On its own thread: a swap waits for the requests in flight, and must hold up nothing else."""
    _internal_auth(request)
    body = _json_body(request)
    project = body.pop("project", None)
    if project is not None and not isinstance(project, str):
        raise ServingError(400, "'project' must be a project slug", "Send {\"project\": \"acme\", ...} or leave it out.")
    server = serving.current(project)
    return JsonResponse(await sync_to_async(server.load, thread_sensitive=False)(body))


# This process's own token as a registered replica, set by serve_policy: FLYWHEEL_REPLICA_TOKEN, or
# inference/tokens.py `replica_token` of FLYWHEEL_INTERNAL_TOKEN and the address it registered. A replica deployed with
# only its own token cannot push to, or load weights on, any other replica.
REPLICA_TOKEN = ""


def internal_token_valid(sent: str) -> bool:
    """`sent` is this process's internal token or its replica token (none configured: nothing is)."""
    tokens = [t for t in (settings.FLYWHEEL_INTERNAL_TOKEN, REPLICA_TOKEN) if t]
    return any(hmac.compare_digest(sent.encode(), t.encode()) for t in tokens)


def _internal_auth(request: HttpRequest) -> None:
    if not settings.FLYWHEEL_INTERNAL_TOKEN and not REPLICA_TOKEN:
        raise ServingError(403, "internal endpoints are off", "Set FLYWHEEL_INTERNAL_TOKEN for both sides.")
    sent = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not internal_token_valid(sent):
        raise ServingError(401, "wrong internal token", "Send 'Authorization: Bearer $FLYWHEEL_INTERNAL_TOKEN'.")


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text format (who may scrape: core/metrics.py)."""
    servers = serving.servers()
    if servers:
        server = serving.current()
        metrics.SERVING_VERSION.labels("production").set(server.engine.version)
        metrics.SERVING_VERSION.labels("canary").set(server.canary.version if server.canary else 0)
        metrics.SERVING_CANARY_SHARE.set(server.canary_share)
        metrics.RECORDER_QUEUE.set(sum(s.recorder.pending() for s in servers.values() if s.recorder is not None))
        metrics.SERVING_ADAPTERS.set(sum(len(s.adapters()) for s in servers.values()))
    return metrics_response(request)


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    servers = serving.servers()
    if not servers:
        return JsonResponse({"ok": False}, status=503)
    server = serving.current()
    return JsonResponse({"ok": True, "version": server.engine.version,
                         "canary": server.canary.version if server.canary else None,
                         **({"projects": {slug: {"version": s.engine.version, "canary": s.canary.version
                                                 if s.canary else None} for slug, s in servers.items()}}
                            if len(servers) > 1 else {})})
