"""The exceptions headlab raises for bad input.

Every message says what was seen and what to do about it. All derive from
:class:`HeadlabError`, so ``except headlab.errors.HeadlabError`` catches them all;
each also derives from the built-in it refines (``ValueError``, ``TypeError``,
``MemoryError``, ...) so generic handlers keep working.

The CLI prints one line per error and exits with :data:`CLI_EXIT_CODE`.
"""

from __future__ import annotations

CLI_EXIT_CODE = 2


class HeadlabError(Exception):
    """Base class of every error headlab raises on purpose."""


class ShapeError(HeadlabError, ValueError):
    """Tensor shapes that do not fit together (head dims, heads vs kv_heads, batch)."""


class MaskError(HeadlabError, ValueError):
    """A mask that does not broadcast, has the wrong dtype, or is used where it cannot be."""


class DTypeError(HeadlabError, TypeError):
    """A non-floating dtype, or tensors whose dtypes differ."""


class DeviceError(HeadlabError, ValueError):
    """Tensors on different devices."""


class UnknownBackendError(HeadlabError, KeyError):
    """A backend name that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class BackendUnsupportedError(HeadlabError, NotImplementedError):
    """A backend asked for a feature it does not support."""


class CostModelError(HeadlabError, NotImplementedError):
    """A backend without a cost formula (an error, never a silent zero)."""


class CountTooLargeError(CostModelError):
    """A prediction refused because counting its tiles would cost more than the prediction is for:
    ``work`` is the estimated number of tile states to evaluate, ``budget`` what headlab allows one
    prediction, ``max_len`` about the longest sequence it counts exactly, and ``bounds`` (or None) a
    ``(low, high)`` range of the visited tiles per (batch, head) where one can be given cheaply."""

    def __init__(self, message: str, *, work: int, budget: int, max_len: int, bounds: tuple[int, int] | None = None):
        super().__init__(message)
        self.work = work
        self.budget = budget
        self.max_len = max_len
        self.bounds = bounds


class MemoryBudgetError(HeadlabError, MemoryError):
    """A request refused before allocation because its estimate exceeds available memory."""

    def __init__(self, message: str, *, estimate_bytes: int, available_bytes: int, alternative: str | None):
        super().__init__(message)
        self.estimate_bytes = estimate_bytes
        self.available_bytes = available_bytes
        self.alternative = alternative


class ConfigError(HeadlabError, ValueError):
    """An invalid configuration value (sizes, counts, options)."""


class SiteError(ConfigError, KeyError):
    """A hook site that does not exist, was not captured, or cannot be edited."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ModelError(HeadlabError, ValueError):
    """A model that cannot be found, loaded or understood."""


class UnsupportedArchitectureError(ModelError):
    """A model family headlab has no adapter for."""


class InputError(HeadlabError, ValueError):
    """Bad user input to a job: empty text, text too long, an output folder in the way."""


class TreebankError(InputError):
    """A treebank file that cannot be read as CoNLL-U (says which line and why), or holds no sentence."""


class PruneError(HeadlabError, ValueError):
    """A head pruning that is refused: a whole layer without the flag, or GQA groups that cannot stay exact."""


class DistributedError(HeadlabError, RuntimeError):
    """Ranks that disagree (shapes, dtypes, options) or a peer that failed or timed out."""
