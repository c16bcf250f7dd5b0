"""Loaded first (`-p tests._env` in pyproject): the test session's environment, set before Django
reads its settings.

Tests share the embedded Redis with a running demo; they use databases 4-7 of it so that a
test Celery worker never takes the demo's tasks (and the other way round).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# This session's Celery messages only reach this session's workers.
os.environ.setdefault("CELERY_KEY_PREFIX", f"test-{os.getpid()}:")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Speed for the suite alone: an embedded PostgreSQL this session starts runs without fsync
# (core/embedded.py; a running durable server stays durable, the demo refuses the switch).
os.environ.setdefault("FLYWHEEL_TEST_PG_UNDURABLE", "1")
# The flush between transactional tests truncates every table; the audit log refuses TRUNCATE
# unless the session says so (training/migrations/0005_audit_chain.py). Only a role holding the
# TRUNCATE privilege (the owner the suite connects as) gets that far; libpq reads PGOPTIONS.
if "allow_audit_truncate" not in os.environ.get("PGOPTIONS", ""):
    os.environ["PGOPTIONS"] = f"{os.environ.get('PGOPTIONS', '')} -c flywheel.allow_audit_truncate=on".strip()
# Without a GPU the Triton kernels are tested in Triton's interpreter. Triton reads this once,
# when it is first imported (vLLM and transformers import it early), so it is set here.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
if not os.environ.get("REDIS_URL"):
    from core import embedded

    os.environ["REDIS_URL"] = embedded.redis_url() + "/4"
# The suite connects as the embedded server's owner: it creates the test database, migrates it and
# flushes it between transactional tests. The application's role (what the demo and a deployment
# connect with) is tested on its own: tests/webapp/test_db_roles.py.
if not os.environ.get("DATABASE_URL"):
    from core import embedded

    os.environ["DATABASE_URL"] = embedded.postgres_url()

# SECRET_KEY, FLYWHEEL_SECRETS_KEY, FLYWHEEL_USER_PEPPER: the settings require them (DEBUG is off
# in tests); the development values under var/ serve here, as they do for the demo.
from core import devsecrets  # noqa: E402

devsecrets.setdefault_environ()
