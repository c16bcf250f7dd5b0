"""Flywheel settings: everything comes from environment variables read through strict helpers.

Defaults run on a fresh clone: with DATABASE_URL / REDIS_URL unset, the embedded PostgreSQL and
Redis under var/ are started (or reused) by core.embedded.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from core.env import ConfigError, env_bool, env_float, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("FLYWHEEL_VAR_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DEBUG", False)


def _secrets() -> dict[str, str]:
    """SECRET_KEY, FLYWHEEL_SECRETS_KEY (Fernet keys for secrets at rest) and FLYWHEEL_USER_PEPPER
    (the HMAC key of user ids) come from the environment; with DEBUG on, missing ones are
    development values kept in var/dev-secrets.json (core.devsecrets)."""
    from core import devsecrets

    values = {name: env_str(name, "") for name in devsecrets.NAMES}
    missing = [name for name, value in values.items() if not value]
    if missing and not DEBUG:
        raise ConfigError(
            f"{', '.join(missing)} must be set when DEBUG is off (each a long random value; "
            "FLYWHEEL_SECRETS_KEY a Fernet key: python -c 'from cryptography.fernet import Fernet; "
            "print(Fernet.generate_key().decode())'). On a development machine: "
            "eval $(.venv/bin/python -m core.devsecrets), or DEBUG=1.")
    if missing:
        values.update({name: devsecrets.dev_secrets()[name] for name in missing})
    from core.secretbox import parse_keys

    try:
        parse_keys(values["FLYWHEEL_SECRETS_KEY"])
    except ValueError as exc:
        raise ConfigError(f"FLYWHEEL_SECRETS_KEY is {exc}") from None
    return values


_SECRETS = _secrets()
SECRET_KEY = _SECRETS["SECRET_KEY"]
FLYWHEEL_SECRETS_KEY = _SECRETS["FLYWHEEL_SECRETS_KEY"]
FLYWHEEL_USER_PEPPER = _SECRETS["FLYWHEEL_USER_PEPPER"]
# Not `testserver`: Django's test client's host is added by the test environment only
# (django.test.utils.setup_test_environment, which pytest-django runs), never served for real.
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# Behind TLS (FLYWHEEL_HTTPS=1, production): cookies only over HTTPS, HSTS, redirects to HTTPS.
# `manage.py check --deploy` is clean with it on (tests/webapp/test_security_settings.py).
FLYWHEEL_HTTPS = env_bool("FLYWHEEL_HTTPS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SECURE_SSL_REDIRECT = FLYWHEEL_HTTPS
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000) if FLYWHEEL_HTTPS else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = SECURE_HSTS_PRELOAD = FLYWHEEL_HTTPS
# A TLS-terminating proxy in front says so in this header (set only when the proxy strips it).
if env_bool("FLYWHEEL_TRUST_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
SECURE_REFERRER_POLICY = "same-origin"
# Password sign-ins (dashboard and admin): this many failures per account or per address within
# the window lock further tries out for the rest of it (webapp/throttle.py).
LOGIN_FAILURES_MAX = env_int("LOGIN_FAILURES_MAX", 5)
LOGIN_FAILURE_WINDOW_S = env_int("LOGIN_FAILURE_WINDOW_S", 900)
# Refused approve/reject/rollback attempts written to the audit log per principal and window;
# past it the caller gets 429 with Retry-After (training.promotion.services.refusal_rate_check).
FLYWHEEL_REFUSALS_MAX = env_int("FLYWHEEL_REFUSALS_MAX", 5)
FLYWHEEL_REFUSAL_WINDOW_S = env_int("FLYWHEEL_REFUSAL_WINDOW_S", 600)
# Training past one process: the train worker runs a run's optimiser steps under torchrun on this
# many processes, the policy sharded with FSDP2 (gloo on CPU, NCCL on GPU; training/runs/updates.py).
FLYWHEEL_TRAIN_NPROC = env_int("FLYWHEEL_TRAIN_NPROC", 1)  # torchrun processes per node (training/rl/nodes.py)
FLYWHEEL_TRAIN_NNODES = env_int("FLYWHEEL_TRAIN_NNODES", 1)  # >1: the other nodes follow the worker's jobs
FLYWHEEL_TRAIN_NODE_RANK = env_int("FLYWHEEL_TRAIN_NODE_RANK", 0)  # 0 on the train worker's node
FLYWHEEL_TRAIN_MASTER_ADDR = env_str("FLYWHEEL_TRAIN_MASTER_ADDR", "")  # node 0's address, reached by the others
FLYWHEEL_TRAIN_MASTER_PORT = env_int("FLYWHEEL_TRAIN_MASTER_PORT", 29500)
FLYWHEEL_TRAIN_JOB_TIMEOUT_S = env_int("FLYWHEEL_TRAIN_JOB_TIMEOUT_S", 3600)  # one torchrun job, whole
FLYWHEEL_TRAIN_COLLECTIVE_TIMEOUT_S = env_int("FLYWHEEL_TRAIN_COLLECTIVE_TIMEOUT_S", 300)  # a hung rank fails its peers


def _database_from_url(url: str) -> dict:
    parsed = urlparse(url)
    if parsed.scheme not in ("postgres", "postgresql"):
        raise ConfigError(f"DATABASE_URL must be postgresql://user:password@host:port/name, got scheme {parsed.scheme!r}")
    query = parse_qs(parsed.query)
    host = query.get("host", [parsed.hostname or ""])[0]
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parsed.path.lstrip("/")) or "flywheel",
        "USER": unquote(parsed.username or "postgres"),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": host,
        "PORT": str(parsed.port or ""),
        "CONN_MAX_AGE": env_int("DB_CONN_MAX_AGE", 0),
        # A kept connection is checked before reuse: after a database restart it is replaced,
        # not failed on (the worker keeps its connections; the web process does not by default).
        "CONN_HEALTH_CHECKS": True,
        # A database that does not answer fails a request in seconds (503), never hangs it.
        "OPTIONS": {"connect_timeout": env_int("DB_CONNECT_TIMEOUT_S", 5)},
        "TEST": {"NAME": env_str("TEST_DATABASE_NAME", "") or None},
    }


def _redis_base() -> str:
    url = env_str("REDIS_URL", "")
    if not url:
        # Imported only when no server is configured: the embedded services are the fallback.
        from core import embedded

        return embedded.redis_url()
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss"):
        raise ConfigError(f"REDIS_URL must be redis://host:port[/db], got {url!r}")
    return url


def _redis_db(base: str, offset: int) -> str:
    # One server, separate numbered databases: broker, results, cache, channels.
    parsed = urlparse(base)
    first = int(parsed.path.lstrip("/") or 0)
    return parsed._replace(path=f"/{first + offset}").geturl()


def _database_urls() -> tuple[str, str]:
    """(DATABASE_URL, DATABASE_OWNER_URL). The application connects with the first, a role that may
    read and write rows but only INSERT and SELECT on the audit log; `manage.py migrate` connects
    with the second, the schema's owner, and then grants the first what it may do
    (webapp/db_roles.py). Without DATABASE_OWNER_URL one role does both (as before: the audit log
    is then append-only by its triggers alone, which that role could drop)."""
    url, owner = env_str("DATABASE_URL", ""), env_str("DATABASE_OWNER_URL", "")
    if url:
        return url, owner or url
    # Imported only when no server is configured (see above): its two roles.
    from core import embedded

    owner_url = embedded.postgres_url()
    return embedded.postgres_app_url(), owner or owner_url


def _databases() -> tuple[dict, dict]:
    url, owner_url = _database_urls()
    app, owner = _database_from_url(url), _database_from_url(owner_url)
    if owner["NAME"] != app["NAME"]:
        raise ConfigError(f"DATABASE_OWNER_URL names database {owner['NAME']!r} but DATABASE_URL names "
                          f"{app['NAME']!r}: both must name the same database (the owner migrates what the "
                          "application uses)")
    return app, owner


_APP_DB, DATABASE_OWNER = _databases()
DATABASES = {"default": _APP_DB}
REDIS_BASE_URL = _redis_base()

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "django_celery_beat",
    "core",
    "feedback",
    "training",
    "webapp",
    "inference",
]

MIDDLEWARE = [
    "core.metrics.RequestMetricsMiddleware",
    # The database away: 503 + Retry-After (JSON on the API, a page on the dashboard).
    "core.errors.StoreUnavailableMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "webapp.urls"
ASGI_APPLICATION = "webapp.asgi.application"
WSGI_APPLICATION = "webapp.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # whitenoise warns about a missing root
STATICFILES_DIRS = [BASE_DIR / "webapp" / "static"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Static files are found without collectstatic too (tests, a fresh clone).
WHITENOISE_USE_FINDERS = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The ingest contract: at most 5 MiB per request body (413 above it).
INGEST_MAX_BODY_BYTES = 5 * 1024 * 1024
INGEST_MAX_EVENTS = 1000
DATA_UPLOAD_MAX_MEMORY_SIZE = INGEST_MAX_BODY_BYTES
# Every listener's body limit, enforced before the body is read (core/bodylimit.py): the web app's
# largest body is an ingest batch; a request without credentials gets the smaller one; a push to a
# serving replica carries weights' deltas and needs its internal token for its limit.
REQUEST_MAX_BODY_BYTES = INGEST_MAX_BODY_BYTES
ANONYMOUS_MAX_BODY_BYTES = env_int("ANONYMOUS_MAX_BODY_BYTES", 64 * 1024)
FLYWHEEL_PUSH_MAX_BYTES = env_int("FLYWHEEL_PUSH_MAX_BYTES", 8 * 1024**3)
# Serving's rate limits, completion requests per minute, shared by replicas through Redis
# (feedback/ratelimit.py `serving_rate_check`); what they record also counts against ingest's.
FLYWHEEL_SERVE_RATE_PER_KEY = env_int("FLYWHEEL_SERVE_RATE_PER_KEY", 600)
FLYWHEEL_SERVE_RATE_PER_PROJECT = env_int("FLYWHEEL_SERVE_RATE_PER_PROJECT", 6000)
INGEST_STATEMENT_TIMEOUT_MS = env_int("INGEST_STATEMENT_TIMEOUT_MS", 15_000)
# Threads (each keeping one database connection) that run the ingest endpoint's database work under
# ASGI (core.dbthreads); 0 runs it in the request's own thread, with a connection of its own.
INGEST_DB_THREADS = env_int("INGEST_DB_THREADS", 4)
# What one read may cost: a page of the read API holds at most this much JSON (and `limit` rows),
# a step's token ids, log-probs and routing at most this many items there (the first ones), and
# the replay page shows at most this many tokens and heatmap columns per step.
READ_PAGE_MAX_BYTES = env_int("READ_PAGE_MAX_BYTES", 2 * 1024 * 1024)
READ_MAX_TOKENS_PER_STEP = env_int("READ_MAX_TOKENS_PER_STEP", 4096)
REPLAY_MAX_TOKENS = env_int("REPLAY_MAX_TOKENS", 2000)

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": _redis_db(REDIS_BASE_URL, 2),
        "KEY_PREFIX": env_str("CACHE_KEY_PREFIX", "flywheel"),
        # The cache is optional (a rate counter): a Redis that does not answer costs a second, not a hang.
        "OPTIONS": {"socket_connect_timeout": 1, "socket_timeout": 1},
    }
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # A Redis that does not answer fails a connect in seconds (pushes are bounded: core/notify.py).
        "CONFIG": {"hosts": [{"address": _redis_db(REDIS_BASE_URL, 3), "socket_connect_timeout": 2}],
                   "prefix": env_str("CHANNELS_PREFIX", "flywheel")},
    }
}

CELERY_BROKER_URL = _redis_db(REDIS_BASE_URL, 0)
CELERY_RESULT_BACKEND = _redis_db(REDIS_BASE_URL, 1)
# Separate key spaces on one Redis (e.g. concurrent test sessions, several deployments).
# A broker that is down or hung fails a publish in seconds (the outbox keeps the message).
CELERY_BROKER_TRANSPORT_OPTIONS = {"socket_connect_timeout": 3, "socket_timeout": 10}
# A worker that loses Redis reconnects for as long as it is away (Celery gives up after 100 tries
# by default, and a person would have to restart it).
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
if env_str("CELERY_KEY_PREFIX", ""):
    CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] = env_str("CELERY_KEY_PREFIX", "")
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
# A task is acknowledged when it finished; a worker that dies under it gives it back to the queue
# (a killed solo worker's unacked message comes back after the visibility timeout; the sweeper,
# core of the self-healing pipeline, does not wait that long: training/runs/sweep.py).
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# Every task is bounded: the soft limit raises inside the task (it fails its work cleanly), the
# hard one kills the child. The gate and training tasks set their own (FLYWHEEL_*_TIME_LIMIT_S).
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 900)
CELERY_TASK_SOFT_TIME_LIMIT = env_int("CELERY_TASK_SOFT_TIME_LIMIT", 840)
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "celery"
CELERY_TASK_ROUTES = {
    "feedback.tasks.*": {"queue": "ingest"},
    "training.tasks.rewards_*": {"queue": "rewards"},
    "training.tasks.train_*": {"queue": "train"},
    "training.tasks.rollout_*": {"queue": "rollouts"},
    "training.tasks.gate_*": {"queue": "gate"},
}
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TIMEZONE = "UTC"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "feedback.auth.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "core.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Flywheel API",
    "DESCRIPTION": "Ingest user feedback and trajectories; read them back; manage model promotions.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "POSTPROCESSING_HOOKS": ["webapp.openapi.postprocess"],  # error responses and links
}

FLYWHEEL_CHECKPOINT_DIR = Path(env_str("FLYWHEEL_CHECKPOINT_DIR", str(VAR_DIR / "checkpoints")))
# Dataset exports (manage.py export_dataset --out under it): an erasure rewrites them without the user's rows.
FLYWHEEL_EXPORT_DIR = Path(env_str("FLYWHEEL_EXPORT_DIR", str(VAR_DIR / "exports")))
FLYWHEEL_INFERENCE_URL = env_str("FLYWHEEL_INFERENCE_URL", "")
# Corpora (training/corpora): blobs by SHA-256 under FLYWHEEL_CORPUS_DIR; bounds of one corpus and
# of one upload to POST /api/v1/corpora (compressed bytes as sent).
FLYWHEEL_CORPUS_DIR = Path(env_str("FLYWHEEL_CORPUS_DIR", str(VAR_DIR / "corpora")))
FLYWHEEL_CORPUS_MAX_FILES = env_int("FLYWHEEL_CORPUS_MAX_FILES", 20_000)
FLYWHEEL_CORPUS_MAX_BYTES = env_int("FLYWHEEL_CORPUS_MAX_BYTES", 200 * 2**20)
FLYWHEEL_CORPUS_MAX_FILE_BYTES = env_int("FLYWHEEL_CORPUS_MAX_FILE_BYTES", 2**20)
FLYWHEEL_CORPUS_UPLOAD_MAX_BYTES = env_int("FLYWHEEL_CORPUS_UPLOAD_MAX_BYTES", 50 * 2**20)


def _internal_url(public: str) -> str:
    # serve_policy's internal listener: loopback, the public port + 1 unless told otherwise.
    if not public:
        return ""
    parsed = urlparse(public)
    return f"http://127.0.0.1:{(parsed.port or 80) + 1}"


# Where promotions reach the serving process's /internal/load (its loopback-only listener).
FLYWHEEL_INFERENCE_INTERNAL_URL = env_str("FLYWHEEL_INFERENCE_INTERNAL_URL", "") or _internal_url(FLYWHEEL_INFERENCE_URL)
# How a promotion reaches the serving process: "http" (its /internal/load) or "record" (a notice only).
FLYWHEEL_DEPLOY_TRANSPORT = env_str("FLYWHEEL_DEPLOY_TRANSPORT", "http" if FLYWHEEL_INFERENCE_URL else "record")
FLYWHEEL_GATE_ENGINE = env_str("FLYWHEEL_GATE_ENGINE", "torch")
# A running training run beats every FLYWHEEL_TRAIN_HEARTBEAT_EVERY_S; one silent for the timeout
# (or queued for the queue timeout) is presumed dead.
FLYWHEEL_TRAIN_HEARTBEAT_EVERY_S = env_float("FLYWHEEL_TRAIN_HEARTBEAT_EVERY_S", 30.0)
FLYWHEEL_TRAIN_HEARTBEAT_TIMEOUT_S = env_int("FLYWHEEL_TRAIN_HEARTBEAT_TIMEOUT_S", 300)
FLYWHEEL_TRAIN_QUEUE_TIMEOUT_S = env_int("FLYWHEEL_TRAIN_QUEUE_TIMEOUT_S", 3600)
# Hard time limits of the training and gate tasks (the soft limit is 60 s earlier). The sweeper
# knows a gate older than its limit has no live task, wherever its worker ran.
FLYWHEEL_TRAIN_TIME_LIMIT_S = env_int("FLYWHEEL_TRAIN_TIME_LIMIT_S", 4 * 3600)
FLYWHEEL_GATE_TIME_LIMIT_S = env_int("FLYWHEEL_GATE_TIME_LIMIT_S", 1800)
# The sweeper (beat): work waiting this long without a worker is queued again, at most this often.
FLYWHEEL_SWEEP_REQUEUE_AFTER_S = env_int("FLYWHEEL_SWEEP_REQUEUE_AFTER_S", 300)
FLYWHEEL_SWEEP_MAX_ATTEMPTS = env_int("FLYWHEEL_SWEEP_MAX_ATTEMPTS", 3)
FLYWHEEL_INTERNAL_TOKEN = env_str("FLYWHEEL_INTERNAL_TOKEN", "")
# A serving replica's own token (`manage.py replica_token ADDRESS` prints it from the one above):
# give a replica this instead of FLYWHEEL_INTERNAL_TOKEN and it can reach no other replica.
FLYWHEEL_REPLICA_TOKEN = env_str("FLYWHEEL_REPLICA_TOKEN", "")
# Serving replicas (training/replicas): each beats every FLYWHEEL_REPLICA_HEARTBEAT_S; one silent
# for FLYWHEEL_REPLICA_STALE_S counts as down (a promotion skips it; it catches up when it returns).
FLYWHEEL_REPLICA_HEARTBEAT_S = env_float("FLYWHEEL_REPLICA_HEARTBEAT_S", 5.0)
FLYWHEEL_REPLICA_STALE_S = env_float("FLYWHEEL_REPLICA_STALE_S", 30.0)
# A serving replica's background rollouts (inference/background.py): at most this many sequences
# of training runs' group rollouts at once, in the room its users leave; 0: it takes none
# (serve_policy --background-rollouts K overrides it). Runs find the replicas that take them.
FLYWHEEL_BACKGROUND_ROLLOUTS = env_int("FLYWHEEL_BACKGROUND_ROLLOUTS", 0)
# Adapter versions served over one engine holding their base (training/replicas/adapters.py): how
# many LoRA adapters a vLLM engine keeps loaded (vLLM's max_loras and max_cpu_loras: production and
# canary of every project on it), and the largest adapter rank it takes (0: the first adapter's,
# rounded up to a rank vLLM supports). FLYWHEEL_SERVE_ADAPTERS=0 serves adapter versions merged.
FLYWHEEL_SERVE_ADAPTERS = env_bool("FLYWHEEL_SERVE_ADAPTERS", True)
FLYWHEEL_SERVE_MAX_LORAS = env_int("FLYWHEEL_SERVE_MAX_LORAS", 4)
FLYWHEEL_SERVE_MAX_LORA_RANK = env_int("FLYWHEEL_SERVE_MAX_LORA_RANK", 0)
# Who may read /metrics (web app and serving process): bearers of this token; unset, loopback only.
FLYWHEEL_METRICS_TOKEN = env_str("FLYWHEEL_METRICS_TOKEN", "")
# Train/inference agreement: on data sampled by the very weights being trained, the behaviour and
# recomputed log-probs agree (~0 nats in fp32). A run above this is flagged and not gated.
FLYWHEEL_MISMATCH_KL_MAX = env_float("FLYWHEEL_MISMATCH_KL_MAX", 0.01)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "WARNING")},
}
