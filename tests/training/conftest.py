"""Fixtures of the training app's Django-level tests: a tiny policy in production, checkpoints
in a tmp store, trajectories with token ids.

    .venv/bin/python -m pytest tests/training/test_services.py tests/training/test_tasks.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = dict(vocab_size=384, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
            max_position=128)


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.pretrain import PolicyConfig, build_policy, stdlib_corpus

    return build_policy(tmp_path_factory.mktemp("tiny-policy"), PolicyConfig(**TINY), stdlib_corpus(3000))


@pytest.fixture(scope="session")
def checkpoint_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture
def ckpt_settings(settings, checkpoint_root):
    settings.FLYWHEEL_CHECKPOINT_DIR = checkpoint_root
    return settings


@pytest.fixture
def production(creds, tiny_policy_dir, ckpt_settings):
    """The tiny policy registered as the project's production v1."""
    from training.versions.services import policy_register

    return policy_register(creds.project, tiny_policy_dir, state="production", config={"kind": "dense"})


@pytest.fixture
def tokenizer(tiny_policy_dir):
    from training.pretrain import load_tokenizer

    return load_tokenizer(tiny_policy_dir)
