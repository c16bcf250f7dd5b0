"""Users' data in the feedback app: consent, retention, redaction, erasure and export of rows."""
