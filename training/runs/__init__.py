"""Training runs: claiming the lineage, the job, steps, the candidate; rollouts for training."""
