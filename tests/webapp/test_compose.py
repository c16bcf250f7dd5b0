"""compose.yaml: every Flywheel service takes its settings from the environment, and names only
variables that Flywheel reads (a typo would silently leave a setting at its default)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
QUEUES = {"celery", "ingest", "rewards", "train", "rollouts", "gate"}
# ${NAME}, ${NAME:-default}, ${NAME:?message}: the value comes from the environment.
FROM_ENV = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(?::?[-?].*)?\}")


def _read_by_flywheel() -> set[str]:
    """Variables the settings module reads through core/env.py, and those the commands read."""
    from core.devsecrets import NAMES  # the secrets settings.py reads by name (required with DEBUG off)

    names = set(re.findall(r'env_\w+\(\s*"([A-Z_][A-Z0-9_]*)"', (ROOT / "webapp" / "settings.py").read_text()))
    names |= set(NAMES)
    for command in ROOT.glob("*/management/commands/*.py"):
        names |= set(re.findall(r'os\.environ\.get\(\s*"([A-Z_][A-Z0-9_]*)"', command.read_text()))
    return names


def _flywheel_services() -> dict[str, dict]:
    return {name: s for name, s in COMPOSE["services"].items() if s.get("build")}


def test_every_flywheel_service_takes_each_setting_from_the_environment():
    services = _flywheel_services()
    assert {"web", "beat", "migrate", "serving", "serving-gpu"} <= set(services)
    for name, service in services.items():
        environment = service["environment"]
        assert environment, name
        for key, value in environment.items():
            assert FROM_ENV.fullmatch(str(value)), f"{name}: {key}={value!r} is not read from the environment"
            assert FROM_ENV.fullmatch(str(value)).group(1) == key, f"{name}: {key} is read from another variable"


def test_the_variables_are_the_ones_the_settings_module_reads():
    read = _read_by_flywheel()
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "FLYWHEEL_SECRETS_KEY", "FLYWHEEL_USER_PEPPER",
            "FLYWHEEL_METRICS_TOKEN"} <= read
    for name, service in _flywheel_services().items():
        unknown = set(service["environment"]) - read
        assert not unknown, f"{name} sets {sorted(unknown)}, which Flywheel never reads"
    # Every setting that matters in production is passed on (test-only ones need not be; the
    # owner's URL goes to the migrate service alone: see the test below).
    missing = read - set(COMPOSE["services"]["web"]["environment"]) - {"DATABASE_OWNER_URL",
        "TEST_DATABASE_NAME", "CELERY_TASK_ALWAYS_EAGER", "CACHE_KEY_PREFIX", "CHANNELS_PREFIX",
        "FLYWHEEL_DEMO_SECRET", "FLYWHEEL_DEMO_TASTE", "FLYWHEEL_DEMO_CORPUS", "FLYWHEEL_APPROVER_KEY",
        "FLYWHEEL_SERVE_KEY"}
    assert not missing, f"compose.yaml does not pass {sorted(missing)}"


def test_the_secrets_have_no_default():
    web = COMPOSE["services"]["web"]["environment"]
    for key in ("SECRET_KEY", "FLYWHEEL_INTERNAL_TOKEN", "FLYWHEEL_METRICS_TOKEN"):
        assert ":?" in web[key], f"{key} must be required (${{{key}:?…}}), never defaulted"


def test_one_worker_per_queue_one_beat_and_serving_with_a_gpu_profile():
    services = COMPOSE["services"]
    served = {}
    for name, service in services.items():
        command = service.get("command") or []
        if command[:4] == ["celery", "-A", "webapp", "worker"]:
            served[name] = command[command.index("-Q") + 1]
    assert sorted(served.values()) == sorted(QUEUES), served
    assert sum(1 for s in services.values() if (s.get("command") or [])[3:4] == ["beat"]) == 1
    assert {"postgres", "redis"} <= set(services)
    gpu = services["serving-gpu"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and "vllm" in services["serving-gpu"]["command"]


def test_only_migrate_connects_as_the_owner_and_the_app_has_a_role_of_its_own():
    services = _flywheel_services()
    owners = {name for name, s in services.items() if "DATABASE_OWNER_URL" in s["environment"]}
    assert owners == {"migrate"}
    app_user = re.search(r"postgresql://(\w+):", services["web"]["environment"]["DATABASE_URL"]).group(1)
    owner_user = re.search(r"postgresql://(\w+):", services["migrate"]["environment"]["DATABASE_OWNER_URL"]).group(1)
    postgres = COMPOSE["services"]["postgres"]
    assert owner_user == postgres["environment"]["POSTGRES_USER"] != app_user
    # The image's init script (a fresh volume) creates the application's login role.
    script = COMPOSE["configs"][postgres["configs"][0]["source"]]["content"]
    assert f"CREATE ROLE {app_user} LOGIN" in script
    assert postgres["configs"][0]["target"].startswith("/docker-entrypoint-initdb.d/")


def test_a_train_node_follows_the_train_worker_s_jobs_on_the_hosts_network():
    services = COMPOSE["services"]
    node = services["train-node"]
    assert node["profiles"] == ["train-node"] and node["network_mode"] == "host"
    assert node["command"][:3] == ["python", "-m", "training.rl.nodes"] and node["command"][3].endswith("/torchrun")
    environment = node["environment"]
    for key in ("FLYWHEEL_TRAIN_NPROC", "FLYWHEEL_TRAIN_NNODES", "FLYWHEEL_TRAIN_NODE_RANK",
                "FLYWHEEL_TRAIN_MASTER_ADDR", "FLYWHEEL_TRAIN_MASTER_PORT", "FLYWHEEL_CHECKPOINT_DIR"):
        assert key in environment and key in services["worker-train"]["environment"], key
    # the module the service runs is there, and reads the settings the compose file passes
    source = (ROOT / "training" / "rl" / "nodes.py").read_text()
    assert all(k in source for k in ("FLYWHEEL_TRAIN_NNODES", "FLYWHEEL_TRAIN_NODE_RANK", "FLYWHEEL_TRAIN_MASTER_ADDR",
                                     "FLYWHEEL_TRAIN_MASTER_PORT"))
