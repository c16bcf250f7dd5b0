"""One error family: the DRF handler and the serving process render the same types
(core/problems.py), so a refusal raised anywhere is one `except ApplicationError` and both shapes
say what was wrong and how to fix it.

    .venv/bin/python -m pytest tests/core/test_problems.py -q
"""

from __future__ import annotations

import json

import pytest

from core import errors
from core.problems import ApplicationError, Conflict, RateLimited, Unauthorized, problem, status_code_name
from inference.apis import _error
from inference.serving import ServingError


def test_the_serving_errors_are_the_families_and_keep_their_status():
    refused = ServingError(409, "the replica holds other weights", "Push the whole set first.",
                           headers={"Retry-After": "3"})
    assert isinstance(refused, ApplicationError)
    assert (refused.status, refused.status_code, refused.code) == (409, 409, "conflict")
    assert ServingError(413, "too big", "Send less.").code == "payload_too_large"
    assert ServingError(418, "odd", "Stop.").code == "error_418"


@pytest.mark.parametrize("status, kind", [(400, "BadRequest"), (401, "Unauthorized"), (409, "Conflict"),
                                          (429, "RateLimited"), (503, "ServiceUnavailable")])
def test_problem_picks_the_familys_type_for_a_status(status, kind):
    made = problem(status, "what", "how")
    assert type(made).__name__ == kind and made.status_code == status and made.fix == "how"
    assert status_code_name(status) == made.code


def test_the_drf_handler_renders_a_serving_error_with_the_house_body():
    response = errors.exception_handler(ServingError(409, "held", "Push the whole set."), {})
    assert response.status_code == 409
    assert response.data == {"error": {"code": "conflict", "message": "held", "fix": "Push the whole set."}}


@pytest.mark.parametrize("raised", [Unauthorized("the key is revoked", "Create a new key."),
                                    RateLimited("over 60 requests a minute", "Retry after 2 s.",
                                                headers={"Retry-After": "2"}),
                                    Conflict("taken", "Use another name.")])
def test_the_serving_side_renders_any_of_the_family_in_openais_shape(raised):
    response = _error(raised)
    body = json.loads(response.content)["error"]
    assert response.status_code == raised.status_code and body["code"] == raised.status_code
    assert body["type"] == "invalid_request_error" and body["message"] == raised.message and body["fix"] == raised.fix
    assert dict(raised.headers).items() <= dict(response.items()).items()
