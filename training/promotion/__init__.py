"""Promotion: a person's (or the canary rule's) decision on what is served, and telling the
serving process. Every state change goes through `training.versions.services.version_transition`
(audited in the same transaction, pushed to the dashboard after commit).

State machine:  candidate → gated → awaiting_approval | rejected
                awaiting_approval → production (or canary → production | rejected) | rejected
                production → retired (replaced) ; retired → production (manual rollback)
"""
