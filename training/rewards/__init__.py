"""Rewards: verifiable checks, judges, the reward spec, judge calibration. Pure Python, no Django."""
