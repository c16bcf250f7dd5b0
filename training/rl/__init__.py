"""Off-policy RL update in plain torch: advantages, loss, router replay, trainer step.

Nothing here imports Django; Django services call in. The run config lives in the torch-free
`training.rl.config` so the web side can validate a run without importing torch.
"""
