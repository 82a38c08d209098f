"""The ``headlab patch`` command (registered on the app when imported)."""
