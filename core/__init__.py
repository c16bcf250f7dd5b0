"""The bottom layer: what every app may import and that imports no app.

Errors (the one error path), notifications to the dashboard, environment helpers and the
embedded PostgreSQL/Redis with their process helpers. Nothing here imports webapp, feedback,
training or inference (import-linter contract in pyproject.toml, `make lint`).
"""
