"""How far an approximate backend (linear, sparse) strays from exact attention: :mod:`.approx`."""
