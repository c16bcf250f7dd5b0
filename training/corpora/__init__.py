"""Corpora: a project's own code, stored content-addressed, with a fixed held-out slice."""
