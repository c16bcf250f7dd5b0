"""Serving replicas: each `serve_policy` process registers (address, versions, heartbeat); a
promotion or canary pushes every live replica only the delta chain it lacks and records its ack;
a replica that was down loads what the database says when it returns."""
