"""The turns of one conversation, linked into one trajectory by the serving process.

A client continues a conversation by sending `metadata.conversation_id` (its own id) or
`previous_response_id` (the `id` of the last answer). Every turn's answer then carries the same
`trajectory_id`; the serving process keeps the growing trajectory in memory and records it once,
when the conversation has been idle `idle_s` seconds, reaches `max_turns`, is ended by the client
(`metadata.conversation_end: true`) or the process shuts down. Feedback may be sent against the
trajectory id at any time (ingest links feedback that arrives before its trajectory).

Each assistant step keeps the prompt token ids the engine was fed for it, so every turn is
trained in exactly its context; the messages the client sent between two answers (tool results,
user turns) become the context steps between them. The state is per process: behind several
serving replicas, route a conversation to one replica (sticky on the conversation id).

Self-summarization (the server's `summary_budget`, serve_policy --summary-budget): when a turn's
prompt + max_tokens would pass the budget, the policy is first asked for a summary of the
conversation up to its last answer (a `user` step with SUMMARY_REQUEST, then the summary as an
`assistant` step marked `summary: true`, recorded like any answer), and the turn is answered in
the compacted context: the first request's messages, the summary as an assistant turn, then the
messages the client sent since the last answer. The client keeps sending its full history; the
server maps it onto the compacted context by count: of the client's messages it reads the first
`prompt_len` (the prompt, as recorded) and those from `kept_from` on, and the summary stands in for
the ones between. The trainer's re-rendering follows the same rule (training/runs/turns.py
`context_messages`).

    .venv/bin/python -m pytest tests/inference/test_tools.py -q
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inference.engines import Engine, SamplingParams
from inference.serving import MAX_MESSAGES, CompletionRequest, PolicyServer, ServingError
from inference.tools import SUMMARY_REQUEST

IDLE_S = 300.0
MAX_TURNS = 64
MAX_OPEN = 10_000


@dataclass
class Conversation:
    key: str
    trajectory_id: str
    owner: int | None = None  # the API key that opened it: only that key sees and continues it
    event: dict[str, Any] | None = None  # the trajectory so far
    seen: int = 0  # messages of the last request already in the trajectory (its prompt or steps)
    turns: int = 0
    last: float = field(default_factory=time.monotonic)
    prompt_len: int = 0  # messages of the first request: the trajectory's prompt
    kept_from: int = 0  # the client's messages before this (after the prompt) are stood in for by the summary
    summary: str | None = None  # the latest summary's text (None: never compacted)

    def context(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages the engine sees for the client's full history `messages`."""
        if self.summary is None or self.event is None:
            return messages
        if len(messages) < self.kept_from:
            raise ServingError(400, f"this conversation was compacted: a summary stands in for its messages "
                               f"{self.prompt_len} to {self.kept_from - 1}, but only {len(messages)} messages were sent",
                               "Send the conversation's full history as before (the server drops the summarized "
                               "messages itself), or start a new conversation.")
        return [*self.event["prompt"], {"role": "assistant", "content": self.summary}, *messages[self.kept_from:]]


Index = tuple[int | None, str]  # (the owning key, the client's conversation id)


class Conversations:
    """Open conversations by (owning key, conversation id) and by response id; `put` receives
    finished trajectories. A conversation takes a slot of the MAX_OPEN only once a turn of it has
    been answered (`add`): a refused request holds nothing."""

    def __init__(self, put: Callable[[list[dict[str, Any]]], None] | None, idle_s: float = IDLE_S,
                 max_turns: int = MAX_TURNS) -> None:
        self.put, self.idle_s, self.max_turns = put, idle_s, max_turns
        self._open: dict[Index, Conversation] = {}
        self._responses: dict[str, Index] = {}  # response id -> its conversation
        self._lock = threading.Lock()

    def find(self, conversation_id: Any, previous_response_id: Any, owner: int | None = None) -> Conversation | None:
        """The conversation a request of key `owner` continues (a new one, not yet registered, for
        an unseen conversation_id). Another key's conversation is answered as one that is not open."""
        self.sweep()
        if previous_response_id is not None:
            index = self._responses.get(previous_response_id) if isinstance(previous_response_id, str) else None
            found = self._open.get(index) if index is not None else None
            if found is None or found.owner != owner:
                raise ServingError(404, "previous_response_id names no open conversation of this serving process",
                                   "Send the id of the last answer within the idle window, or start over "
                                   "without previous_response_id.")
            return found
        if conversation_id is None:
            return None
        if not isinstance(conversation_id, str) or not 0 < len(conversation_id) <= 200:
            raise ServingError(400, "'metadata.conversation_id' must be a string of 1 to 200 characters",
                               "Send your own id for the conversation, the same on every turn.")
        with self._lock:
            found = self._open.get((owner, conversation_id))
            if found is None and len(self._open) >= MAX_OPEN:
                raise ServingError(429, f"{MAX_OPEN} conversations are open on this serving process",
                                   "End conversations with metadata.conversation_end, or retry later.",
                                   headers={"Retry-After": str(int(self.idle_s))})
            return found or Conversation(conversation_id, f"traj_{uuid.uuid4().hex}", owner)

    def open_count(self) -> int:
        return len(self._open)

    def add(self, conversation: Conversation, event: dict[str, Any], messages: list[dict[str, Any]],
            response_id: str, end: bool = False) -> None:
        """One served turn (`event`: the single-turn trajectory the server would record) joins the
        conversation's trajectory; the request's messages not yet in it become context steps."""
        with self._lock:
            index = (conversation.owner, conversation.key)
            if index not in self._open and len(self._open) < MAX_OPEN:
                self._open.setdefault(index, conversation)
            # Full meanwhile, or a concurrent first turn of the same id won: recorded, not kept open.
            registered = self._open.get(index) is conversation
            step = event["steps"][0]
            if conversation.event is None:
                conversation.event = {**event, "id": conversation.trajectory_id, "steps": [step]}
                conversation.prompt_len = conversation.kept_from = len(messages)
            else:
                new = messages[_after_last_answer(messages, conversation.seen):]
                conversation.event["steps"] += [_context_step(m) for m in new] + [step]
            conversation.seen = len(messages) + 1  # the client sends this answer back next time
            conversation.turns += 1
            conversation.last = time.monotonic()
            if registered:
                self._responses[response_id] = index
            done = end or conversation.turns >= self.max_turns or not registered
        if done:
            self._finish([conversation])

    def compacted(self, conversation: Conversation, steps: list[dict[str, Any]], kept_from: int, summary: str) -> None:
        """The summary request and the summary join the trajectory; later turns read the client's
        messages from `kept_from` on after the summary."""
        with self._lock:
            assert conversation.event is not None
            conversation.event["steps"] += steps
            conversation.kept_from, conversation.summary = kept_from, summary
            conversation.last = time.monotonic()

    def sweep(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            idle = [c for c in self._open.values() if now - c.last >= self.idle_s]
        self._finish(idle)

    def close(self) -> None:
        with self._lock:
            everything = list(self._open.values())
        self._finish(everything)

    def _finish(self, conversations: list[Conversation]) -> None:
        with self._lock:
            for c in conversations:
                if self._open.get((c.owner, c.key)) is c:
                    del self._open[(c.owner, c.key)]
            self._responses = {r: k for r, k in self._responses.items() if k in self._open}
        events = [c.event for c in conversations if c.event is not None]
        if events and self.put is not None:
            self.put(events)


def _after_last_answer(messages: list[dict[str, Any]], seen: int) -> int:
    """Where the messages new to the trajectory start: after the answer the client sent back
    (normally at `seen`); a client that rewrote its history starts after its last assistant turn."""
    if 0 < seen <= len(messages) and messages[seen - 1]["role"] == "assistant":
        return seen
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    return last + 1


def _context_step(message: dict[str, Any]) -> dict[str, Any]:
    step = {"role": message["role"], "content": message["content"]}
    if message.get("tool_call_id"):
        step["tool_call_id"] = message["tool_call_id"]
    return step


_BY_SERVER: weakref.WeakKeyDictionary[PolicyServer, Conversations] = weakref.WeakKeyDictionary()


def conversations_for(server: PolicyServer) -> Conversations:
    """The server's open conversations; recorded into its recorder, flushed when it closes."""
    found = _BY_SERVER.get(server)
    if found is None:
        found = _BY_SERVER[server] = Conversations(server.recorder.put if server.recorder is not None else None)
        server.on_close.append(found.close)
    return found


Render = Callable[[Engine, list[dict[str, Any]]], list[int]]  # messages -> the prompt ids the engine is fed


@dataclass
class Link:
    """A request's place in a conversation: where its turn is recorded, the trajectory id, the
    client's full history, and whether this request compacted the conversation."""

    conversation: Conversation
    record: Callable[[list[dict[str, Any]]], None]
    registry: Conversations | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    summary_tokens: int | None = None  # the summary this request compacted the conversation with

    @property
    def trajectory_id(self) -> str:
        return self.conversation.trajectory_id

    def read(self) -> list[dict[str, Any]]:
        """The messages the engine will see (before any compaction this turn)."""
        return self.conversation.context(self.messages)

    async def prepare(self, server: PolicyServer, engine: Engine, model: str, sampling: SamplingParams,
                      render: Render) -> list[dict[str, Any]]:
        """The turn's context; first compacted with a summary when it would pass the budget."""
        c, context = self.conversation, self.read()
        if not server.summary_budget or len(render(engine, context)) + sampling.max_tokens <= server.summary_budget:
            return context
        start = _after_last_answer(self.messages, c.seen)
        if c.event is None or start <= c.kept_from:  # no answer since the last summary: nothing to summarize
            return context
        ask = [*c.context(self.messages[:start]), {"role": "user", "content": SUMMARY_REQUEST}]
        ids = render(engine, ask)
        if len(ids) + sampling.max_tokens > server.max_model_len:
            raise ServingError(400, f"this conversation is over the summary budget ({server.summary_budget} tokens) "
                               f"but asking for its summary takes {len(ids)} tokens + max_tokens "
                               f"{sampling.max_tokens}; the context holds {server.max_model_len}",
                               "Lower max_tokens, start the serving process with a lower --summary-budget, "
                               "or start a new conversation.")
        request = CompletionRequest(model, ids, ask, 1, sampling, False, "summary", record=_discard)
        served = await server.acomplete(request, engine)
        summary = served.completions[0]
        step = {**server.step_of(request, summary, c.trajectory_id, engine.tokenizer), "summary": True}
        assert self.registry is not None
        # The summary stands in the context as recorded (its text, NUL-free): the trainer's
        # re-rendering of a text-only trajectory then matches what the engine was fed.
        self.registry.compacted(c, [{"role": "user", "content": SUMMARY_REQUEST}, step], start, step["content"])
        self.summary_tokens = len(summary.token_ids)
        return self.read()

    def extension(self) -> dict[str, Any]:
        """The response's `flywheel.compaction` once the conversation has been compacted."""
        c = self.conversation
        if c.summary is None:
            return {}
        now = self.summary_tokens is not None
        return {"compaction": {"summarized_now": now, "summary": c.summary,
                               "messages_summarized": c.kept_from - c.prompt_len, "kept_from": c.kept_from,
                               **({"summary_tokens": self.summary_tokens} if now else {})}}


def _discard(events: list[dict[str, Any]]) -> None:
    """A summary is recorded as a step of its conversation, never as a trajectory of its own."""


def check_read_size(messages: list[dict[str, Any]]) -> None:
    """The message bound, on what the server reads (a compacted conversation's full history may be longer)."""
    if len(messages) > MAX_MESSAGES:
        raise ServingError(400, f"'messages' must be a list of 1 to {MAX_MESSAGES} messages (after a conversation's "
                           "summary: its prompt and the messages since)",
                           'Send [{"role": "user", "content": "..."}], or continue a long conversation with '
                           "metadata.conversation_id so that the server summarizes it.")


def link(server: PolicyServer, body: dict[str, Any], messages: list[dict[str, Any]],
         owner: int | None = None) -> Link | None:
    """None for a request outside any conversation (recorded on its own, as before). `owner`:
    the API key of the request; a conversation is continued only by the key that opened it."""
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    registry = conversations_for(server)
    conversation = registry.find(metadata.get("conversation_id"), body.get("previous_response_id"), owner)
    if conversation is None:
        return None
    if body.get("n", 1) not in (1, None):
        raise ServingError(400, "a conversation continues one answer: 'n' must be 1 with a conversation",
                           "Leave n out, or drop conversation_id / previous_response_id.")
    end = metadata.get("conversation_end") is True

    def record(events: list[dict[str, Any]]) -> None:
        registry.add(conversation, events[0], messages, events[0]["id"], end)

    return Link(conversation, record, registry, messages)
