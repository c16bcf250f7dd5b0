"""Where Celery finds the training app's tasks (`app.autodiscover_tasks()` imports `training.tasks`).

Each entity keeps its tasks next to its services: rewards, runs, gate, promotion. Task names
(`training.tasks.*`) are a wire contract — beat rows and queued messages carry them, and
settings.CELERY_TASK_ROUTES routes on them — so they stay as they were when the tasks moved.
"""

from training.gate.tasks import gate_run_enqueue, gate_run_task
from training.promotion.tasks import gate_canaries_check_task
from training.rewards.tasks import rewards_compute_pending
from training.runs.tasks import pipeline_sweep_task, rollout_and_train_task, train_maybe, train_policy_task

__all__ = ["gate_canaries_check_task", "gate_run_enqueue", "gate_run_task", "pipeline_sweep_task",
           "rewards_compute_pending", "rollout_and_train_task", "train_maybe", "train_policy_task"]
