"""The ``headlab generate`` command (registered on the app when imported)."""
