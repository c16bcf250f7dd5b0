"""Schemathesis against /api/schema/, as a client with valid credentials would use the API: every
operation is called with generated requests (valid ones, then invalid ones), the ingest webhook
with signed bodies, the other operations with an admin key, on a project seeded with the
trajectories and versions the path parameters point at; then the stateful phase follows the
schema's links (ingest → the stored trajectory, a version → its approve/reject/rollback).

Every response must be no 5xx, have a documented status and content type, and match its schema.
Bounded: a fixed number of examples per operation, derandomized (the same cases every run).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from django.db import transaction
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from feedback.services import api_key_create, feedback_ingest, membership_set, service_account_get
from tests.factories import feedback, sign, trajectory
from training.models import GateReport, PolicyVersion

pytestmark = pytest.mark.django_db

EXAMPLES = {GenerationMode.POSITIVE: 10, GenerationMode.NEGATIVE: 5}
INGEST = "/api/v1/events"


def _settings(examples: int, **extra: Any) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck), **extra)


@pytest.fixture
def seeded(creds) -> dict[str, Any]:
    """Trajectories (with feedback) and versions in each state the promotion operations act on."""
    project = creds.project
    feedback_ingest(project, [trajectory(f"traj-{i}") for i in range(3)] + [feedback("fb-1", "traj-0")])
    v1 = PolicyVersion.objects.create(project=project, number=1, state="retired")
    v2 = PolicyVersion.objects.create(project=project, number=2, parent=v1, state="production")
    v3 = PolicyVersion.objects.create(project=project, number=3, parent=v2, state="awaiting_approval")
    v4, v5 = (PolicyVersion.objects.create(project=project, number=n, parent=v2, state="awaiting_approval")
              for n in (4, 5))
    GateReport.objects.create(version=v3, baseline=v2, passed=True, policy={"version": 0},
                              checks=[{"name": "reward_improvement", "value": 0.2, "threshold": 0.0,
                                       "interval": [0.1, 0.3], "passed": True, "detail": ""}])
    fuzzer = service_account_get("fuzzer")  # an approver: the decisions reach the promotion service
    membership_set(project, fuzzer, "approver")
    return {"creds": creds, "key": api_key_create(project, ["admin"], name="fuzzer", owner=fuzzer),
            "version_id": [v.id for v in (v1, v2, v3, v4, v5)], "external_id": ["traj-0", "traj-1", "traj-2"],
            "user": ["u-42"]}  # the seeded feedback's user (a subject access export)


@pytest.fixture
def api(seeded):
    """The schema, served in-process by the WSGI application on the test's transaction."""
    from django.core import signals
    from django.db import close_old_connections

    from webapp.wsgi import application

    # As Django's test client does: a request must not close the connection that holds the
    # test's transaction (and its seeded rows).
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield schemathesis.openapi.from_wsgi("/api/schema/", application)
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


def call_kwargs(case, seeded: dict[str, Any]) -> dict[str, Any]:
    """A signed delivery for the webhook (signed over the exact bytes sent), the admin key elsewhere."""
    if case.operation.path != INGEST:
        return {"headers": {"Authorization": f"Bearer {seeded['key']}"}}
    if case.body is NOT_SET:
        body = b""
    elif isinstance(case.body, bytes):  # invalid cases may carry raw bytes
        body = case.body
    else:
        body = json.dumps(case.body).encode()
    creds = seeded["creds"]
    # A body that is not UTF-8 is refused before its signature is checked; it is signed as text anyway.
    headers = {**sign(creds.webhook_secret, body.decode("utf-8", "replace")), "flywheel-project": creds.project.slug,
               "Content-Type": case.media_type or "application/json"}
    return {"headers": headers, "data": body}


# Rules the published schema does not carry, each refused with a 400 that says how to fix it
# (every other check still runs on these operations): a corpus upload must hold text files, not
# binary or empty ones (a schema cannot say so); a pagination cursor is opaque, valid only as the
# API gave it (a forged one is a 400, never a 500); a mid-training request gives steps or
# minutes, exactly one (to publish as a oneOf in the schema, then drop it from here); a project's
# training config is a run's whole settings, checked by their typed home (training/runs/settings.py:
# its keys, bounds and cross-field rules, a LoRA's target modules against the project's policy).
CONTENT_CHECKED = {"POST /api/v1/corpora", "GET /api/v1/trajectories", "POST /api/v1/midtrain",
                   "PUT /api/v1/training-config"}


def overridden(case) -> list:
    """An invalid Authorization header the fuzzer generated is replaced by the valid key before the
    call, so such a case is not an invalid request any more: the server is right to accept it."""
    excluded = [positive_data_acceptance] if case.operation.label in CONTENT_CHECKED else []
    if case.meta is not None and case.meta.is_negative_at(ParameterLocation.HEADER):
        excluded.append(negative_data_rejection)
    return excluded


def strategy(operation, mode: GenerationMode, seeded: dict[str, Any]):
    """Generated cases, and as many again whose path points at a seeded row (otherwise nearly
    every generated id is a 404 that never reaches the handler)."""
    names = [p.name for p in operation.path_parameters]
    if not names:
        return operation.as_strategy(generation_mode=mode)
    pointed = [operation.as_strategy(generation_mode=mode, path_parameters={names[0]: value})
               for value in seeded[names[0]]]
    return st.one_of(operation.as_strategy(generation_mode=mode), *pointed)


def test_every_operation_answers_within_its_schema(api, seeded):
    statuses: dict[str, set[int]] = {}
    stored: set[str] = set()
    for result in api.get_all_operations():
        operation = result.ok()
        for mode, examples in EXAMPLES.items():

            @_settings(examples)
            @given(case=strategy(operation, mode, seeded))
            def run(case):
                kwargs = call_kwargs(case, seeded)
                response = case.call(**kwargs)
                statuses.setdefault(case.operation.label, set()).add(response.status_code)
                if response.status_code == 202:
                    stored.update(r["id"] for r in response.json()["results"] if r["status"] == "accepted")
                case.validate_response(response, headers=kwargs["headers"], transport_kwargs=kwargs,
                                       excluded_checks=overridden(case))

            run()
    # The cases reached the handlers: each operation answered at least once with success (or,
    # for a promotion, with the service's 409 on a real version in a state that forbids it).
    # (A corpus upload and a mid-training request succeed only with real files and weights: their
    # own tests, tests/training/corpora/test_corpora.py and test_midtrain.py, reach them.)
    reached = {label for label, codes in statuses.items() if codes & {200, 202, 409}}
    reached |= {"POST /api/v1/corpora", "POST /api/v1/midtrain"} & set(statuses)
    assert reached == set(statuses), {label: sorted(codes) for label, codes in statuses.items()}
    assert len(stored) >= 5, stored  # generated events pass the parser and are stored, not only refused


def test_the_stateful_phase_follows_the_links(api, seeded):
    class Workflow(api.as_state_machine()):
        # Each scenario starts from the seeded rows: what it generates next depends on what the
        # API answered, which must not depend on what earlier scenarios approved or stored.
        def setup(self):
            self.savepoint = transaction.savepoint()

        def teardown(self):
            transaction.savepoint_rollback(self.savepoint)

        def get_call_kwargs(self, case):
            return call_kwargs(case, seeded)

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            case.validate_response(response, headers=kwargs["headers"], transport_kwargs=kwargs,
                                   excluded_checks=overridden(case))

    Workflow.run(settings=_settings(8, stateful_step_count=4))
