"""The atlas's kinds, in page order, and the role each gives a head (see :mod:`headlab.interpret.atlas`)."""

KINDS = ("previous_token", "duplicate_token", "induction", "retrieval", "sink", "local", "syntactic")
ROLE = {"previous_token": "previous-token", "duplicate_token": "duplicate-token", "induction": "induction",
        "retrieval": "retrieval", "sink": "sink", "local": "local", "syntactic": "syntactic"}

__all__ = ["KINDS", "ROLE"]
