"""The evaluation gate: statistics, reward-hacking detectors, the suite runner and the canary
stopping rule. Pure Python/numpy at import (no Django, no torch); Django code lives in
`training.promotion` and the Celery tasks in `training.gate.tasks`.

    .venv/bin/python -m pytest tests/training -q -k "gate or promotion"
"""
