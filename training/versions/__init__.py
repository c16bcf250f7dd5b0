"""Policy versions: the one home for their reads (production, the serving target) and writes
(registering weights, the audited state transition)."""
