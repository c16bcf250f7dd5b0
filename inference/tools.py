"""Tool calls in chat completions: OpenAI-style `tools` and `tool_calls` in, the chat template's
<tool_call>{"name": ..., "arguments": {...}}</tool_call> format out and back.

The chat template renders the request's `tools` and every assistant message's `tool_calls`
(training/pretrain.py CHAT_TEMPLATE); `parse_tool_calls` reads the policy's answer back into
OpenAI `tool_calls`. An answer whose tool-call markup does not parse (unclosed tag, not JSON,
a tool the request did not offer) is answered with finish_reason "invalid_tool_call" and its text
as content: the client sees what the policy wrote; it is never a 5xx. Tool results come back as
`tool` messages in the next request.

    .venv/bin/python -m pytest tests/inference/test_tools.py -q
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inference.serving import ServingError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ROLES = ("system", "user", "assistant", "tool")
MAX_TOOLS = 32
MAX_NAME_CHARS = 64
INVALID = "invalid_tool_call"
# What the policy is asked when a context is compacted: by the serving process in a conversation
# over its budget, and by sandboxed agent rollouts (one text, so the trained summaries are alike).
SUMMARY_REQUEST = "Summarize the task, what you did and what is left, briefly."
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class Answer:
    """The policy's text as an OpenAI assistant message."""

    content: str
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str


def tools_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's `tools`, checked: a list of {"type": "function", "function": {"name", ...}}."""
    tools = body.get("tools")
    if tools is None:
        return []
    fix = 'Send [{"type": "function", "function": {"name": "read_file", "parameters": {...}}}].'
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ServingError(400, f"'tools' must be a list of at most {MAX_TOOLS} functions", fix)
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not _NAME.match(function["name"]):
            raise ServingError(400, f"tools[{i}] must be a function with a name of 1 to {MAX_NAME_CHARS} "
                               "letters, digits, '_' or '-'", fix)
    return tools


def messages_of(raw: Any, limit: int) -> list[dict[str, Any]]:
    """Chat messages with tool calls and tool results, checked and normalised (content a string)."""
    if not isinstance(raw, list) or not raw or len(raw) > limit:
        raise ServingError(400, f"'messages' must be a list of 1 to {limit} messages",
                           'Send [{"role": "user", "content": "..."}].')
    return [_message(i, m) for i, m in enumerate(raw)]


def _message(i: int, m: Any) -> dict[str, Any]:
    role = m.get("role") if isinstance(m, dict) else None
    calls = m.get("tool_calls") if isinstance(m, dict) else None
    content = m.get("content") if isinstance(m, dict) else None
    if content is None and role == "assistant" and calls:
        content = ""
    if role not in ROLES or not isinstance(content, str):
        raise ServingError(400, f"messages[{i}] needs a 'role' of {list(ROLES)} and a string 'content'",
                           "Fix that message (an assistant message with tool_calls may have content null).")
    out: dict[str, Any] = {"role": role, "content": content}
    if calls is not None:
        if role != "assistant":
            raise ServingError(400, f"messages[{i}] has tool_calls but is a {role!r} message",
                               "Only assistant messages carry tool_calls.")
        out["tool_calls"] = [_call(i, k, c) for k, c in enumerate(calls if isinstance(calls, list) else [None])]
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not 0 < len(call_id) <= 255:
            raise ServingError(400, f"messages[{i}] is a tool result without a 'tool_call_id'",
                               "Send the id of the tool call it answers (choices[0].message.tool_calls[k].id).")
        out["tool_call_id"] = call_id
    return out


def _call(i: int, k: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(name, str) or not _NAME.match(name) or not isinstance(arguments, str | dict):
        raise ServingError(400, f"messages[{i}].tool_calls[{k}] must be {{\"id\", \"type\": \"function\", "
                           "\"function\": {\"name\", \"arguments\"}}", "Send the tool call as it was answered.")
    call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{uuid.uuid4().hex[:24]}"
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def parse_tool_calls(text: str, finish_reason: str, tools: list[dict[str, Any]], call_prefix: str) -> Answer:
    """The answer's tool calls (finish_reason "tool_calls"), or its text as content when it has
    none; markup that does not parse gives finish_reason "invalid_tool_call". Call ids are
    `call_<call_prefix>_<k>`: the answer and the recorded step name them alike."""
    if not tools or OPEN not in text:
        return Answer(text, None, finish_reason)
    offered = {t["function"]["name"] for t in tools}
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            return Answer(text, None, INVALID)
        if not isinstance(call, dict) or call.get("name") not in offered or not isinstance(call.get("arguments", {}), dict):
            return Answer(text, None, INVALID)
        calls.append({"id": f"call_{call_prefix}_{len(calls)}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    if not calls or text.count(OPEN) != len(calls):  # an unclosed or nested tag
        return Answer(text, None, INVALID)
    return Answer(text[: text.index(OPEN)], calls, "tool_calls")


def answer_of(tools: list[dict[str, Any]], text: str, finish_reason: str, trajectory_id: str) -> Answer:
    """The served answer of one completion (its trajectory id names its tool calls)."""
    return parse_tool_calls(text, finish_reason, tools, trajectory_id.removeprefix("traj_")[:16])


def recorded_fields(tools: list[dict[str, Any]]) -> Callable[[Any, str], dict[str, Any]] | None:
    """The step fields a completion is recorded with when tools were offered: its parsed tool
    calls and content, and the finish reason the client saw."""
    if not tools:
        return None

    def fields(completion: Any, trajectory_id: str) -> dict[str, Any]:
        answer = answer_of(tools, completion.text, completion.finish_reason, trajectory_id)
        out: dict[str, Any] = {"finish_reason": answer.finish_reason, "tools": [t["function"]["name"] for t in tools]}
        if answer.tool_calls:
            out.update(content=answer.content.replace("\x00", "\ufffd"), tool_calls=answer.tool_calls)
        return out

    return fields
