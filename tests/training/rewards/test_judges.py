"""Judges: the rule rubric is deterministic; the model judge parses strictly and fails loudly.

The model endpoint is the one true external boundary, so a tiny local HTTP server stands in for it.

    .venv/bin/python -m pytest tests/training/rewards/test_judges.py -q
"""

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from training.rewards.judges import JUDGES, ModelJudge, RuleRubricJudge, make_judge

ASPECTS = {"style": "readable, idiomatic code", "correctness": "does what the prompt asks"}
GOOD = json.dumps({"scores": {"style": {"score": 0.8, "rationale": "tidy"},
                              "correctness": {"score": 1, "rationale": "right"}}})


class FakeEndpoint:
    """Answers /v1/chat/completions with the queued (status, content) replies, then repeats the last.
    With `hold`, every request waits for that event before it is answered."""

    def __init__(self, replies: list[tuple[int, str]], hold: threading.Event | None = None) -> None:
        self.replies, self.requests = list(replies), []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                endpoint.requests.append((self.path, json.loads(self.rfile.read(length)), dict(self.headers)))
                if hold is not None:
                    hold.wait()
                status, content = endpoint.replies.pop(0) if len(endpoint.replies) > 1 else endpoint.replies[0]
                body = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})
                payload = body.encode() if status == 200 else b'{"error": "boom"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.fixture
def endpoint() -> Iterator[callable]:
    servers = []

    def start(*replies: tuple[int, str], hold: threading.Event | None = None) -> FakeEndpoint:
        fake = FakeEndpoint(list(replies), hold)
        threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(fake.server)
        return fake

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def model_judge(url: str, **extra) -> ModelJudge:
    # The stand-in endpoint is on loopback, which a judge reaches only where the deployment allows it.
    return make_judge({"kind": "model", "base_url": url, "model": "judge-1", "aspects": ASPECTS,
                       "api_key": "sk-test", "backoff_s": 0.0, "timeout_s": 5.0, **extra},
                      allowed_networks=["127.0.0.0/8"])


def test_the_model_judge_parses_per_aspect_scores_and_rationales(endpoint):
    fake = endpoint((200, "```json\n" + GOOD + "\n```"))
    result = model_judge(fake.url).judge("def add(a, b):", " return a + b")
    assert not result.failed and result.values() == {"style": 0.8, "correctness": 1.0}
    assert result.scores["style"].rationale == "tidy" and result.judge_id.startswith("model:judge-1:")
    path, body, headers = fake.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "judge-1"
    assert headers["Authorization"] == "Bearer sk-test" and "correctness" in body["messages"][0]["content"]


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("Sure! Here are the scores: style 0.8", "not JSON"),
        ('{"scores": {"style": {"score": 0.8, "rationale": "ok"}', "not JSON"),
        ('{"style": 0.8, "correctness": 1}', "no 'scores' object"),
        ('{"scores": {"style": {"score": 0.8, "rationale": "ok"}}}', "'correctness' missing"),
        ('{"scores": {"style": {"score": 1.7, "rationale": "x"}, "correctness": {"score": 1, "rationale": "x"}}}',
         "outside [0, 1]"),
        ('{"scores": {"style": {"score": "high", "rationale": "x"}, "correctness": {"score": 1, "rationale": "x"}}}',
         "is not a number"),
        ('{"scores": {"style": {"score": 0.5}, "correctness": {"score": 1, "rationale": "x"}}}', "no rationale"),
    ],
)
def test_malformed_output_is_a_failed_score_with_a_reason_never_a_silent_zero(endpoint, content, why):
    fake = endpoint((200, content))
    result = model_judge(fake.url, retries=1).judge("p", "c")
    assert result.failed and len(fake.requests) == 2  # retried once, then gave up
    for score in result.scores.values():
        assert score.score is None and score.failed
        assert "judge failed after 2 attempt(s)" in score.rationale and why in score.rationale


def test_it_retries_transient_failures_and_malformed_output_then_succeeds(endpoint):
    fake = endpoint((503, ""), (200, "not json"), (200, GOOD))
    result = model_judge(fake.url, retries=2).judge("p", "c")
    assert not result.failed and len(fake.requests) == 3


def test_a_client_error_is_not_retried(endpoint):
    fake = endpoint((401, ""))
    result = model_judge(fake.url, retries=3).judge("p", "c")
    assert result.failed and len(fake.requests) == 1 and "HTTP 401" in result.scores["style"].rationale


def test_an_unreachable_endpoint_fails_with_a_reason():
    result = model_judge("http://127.0.0.1:9/v1", retries=0).judge("p", "c")
    assert result.failed and "transport error" in result.scores["correctness"].rationale


def test_the_rule_rubric_is_deterministic_and_scores_each_aspect():
    judge = make_judge({"kind": "rule", "max_line": 40, "concision_chars": 60})
    clean = judge.judge("add", "def add(a, b):\n    return a + b\n")
    assert clean.values() == {"style": 1.0, "concision": 1.0, "correctness": 1.0}
    messy = "def AddNumbers(FirstValue, b):\n    return FirstValue + b  # a very long trailing comment here\n" * 2
    result = judge.judge("add", messy)
    assert result == judge.judge("add", messy)  # deterministic
    assert result.scores["style"].score < 1 and "AddNumbers" in result.scores["style"].rationale
    assert result.scores["concision"].score < 0.5 and "repeated" in result.scores["concision"].rationale
    broken = judge.judge("add", "def add(a, b) return a + b\n")
    assert broken.scores["correctness"].score == 0.0 and "syntax error" in broken.scores["correctness"].rationale


def test_the_rule_rubric_runs_configured_checks_with_weights():
    judge = RuleRubricJudge(
        aspects=("correctness",),
        checks=[{"name": "python_compiles", "weight": 1.0},
                {"name": "python_tests", "weight": 3.0, "tests": "assert add(1, 2) == 3", "cpu_s": 1}],
    )
    assert judge.judge("p", "def add(a, b):\n    return a + b\n").values() == {"correctness": 1.0}
    assert judge.judge("p", "def add(a, b):\n    return a * b\n").values() == {"correctness": 0.25}
    assert judge.judge_id != RuleRubricJudge().judge_id  # the config is part of the judge version


def test_the_factory_refuses_unknown_kinds():
    assert {"rule", "rule_rubric", "model"} <= set(JUDGES)
    with pytest.raises(ValueError, match="unknown judge kind"):
        make_judge({"kind": "oracle"})
