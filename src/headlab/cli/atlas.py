"""The ``headlab atlas`` command (registered on the app when imported)."""
