"""Users' data in training: which runs and versions learned from which rows; erasure."""
