"""The Celery app. Run a worker with:

    .venv/bin/celery -A webapp worker -Q celery,ingest,rewards,train,rollouts,gate -l info
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")

# Every task retries with backoff while the database is down (core/retry.py).
app = Celery("flywheel", task_cls="core.retry:StoreRetryTask")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
