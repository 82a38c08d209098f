"""Clean/corrupted prompt pairs with a metric, for circuit discovery: IOI, greater-than, induction, retrieval.

Every builder returns a :class:`TaskPairs`: ``B`` clean prompts, their corrupted twins (the same length
token by token and the same attention mask, so that patching replaces position ``i`` by position ``i``),
and a metric ``metric(logits (B, L, V)) -> (B,)`` as :func:`headlab.patch` takes it. Prompts are
right-padded; every metric reads each row at its last *real* token. A pair whose clean and corrupted
prompts tokenise to different lengths is dropped and another one drawn.

- ``ioi`` (Wang et al. 2022): "Then, Mary and John went to the store. John gave a drink to" -> " Mary";
  corrupted: the same template with three other, all-different names; metric logit(IO) - logit(S).
- ``greater-than`` (Hanna et al. 2023): "The war lasted from the year 1732 to the year 17"; corrupted:
  YY = "01"; metric p(year > YY) - p(year <= YY) (on a digit-by-digit tokenizer, over the tens digit:
  see :func:`greater_than`).
- ``induction`` (Olsson et al. 2022): random tokens x_1..x_T x_1..x_T; corrupted: y_1..y_T x_1..x_T;
  metric the mean log-probability of the right next token over the second half.
- ``retrieval`` (associative recall): "Emily Moscow. Michael Paris. Richard London. Michael" -> " Paris";
  corrupted: the query names another key of the context; metric logit(V) - logit(V').

    >>> import torch
    >>> from headlab.models.transformer import Transformer, TransformerConfig
    >>> m = Transformer(TransformerConfig(vocab_size=50, d_model=16, n_layers=1, n_heads=2, causal=True)).eval()
    >>> pairs = induction(m, n=4, half=5, vocab=50)
    >>> pairs.clean["input_ids"].shape, pairs.metric.__name__, len(pairs.subset([0, 2]))
    (torch.Size([4, 10]), 'induction_logprob', 2)
"""

from __future__ import annotations

from headlab.interpret.circuits.tasks.base import PairMetric, TaskPairs, mean_logprob, signed_prob
from headlab.interpret.circuits.tasks.greater_than import CENTURY, GREATER_THAN, NOUNS, greater_than
from headlab.interpret.circuits.tasks.induction import induction
from headlab.interpret.circuits.tasks.ioi import ABBA, BABA, NAMES, OBJECTS, PLACES, ioi, ioi_prompts
from headlab.interpret.circuits.tasks.registry import TASKS, task
from headlab.interpret.circuits.tasks.retrieval import CITIES, SEPARATORS, retrieval

__all__ = [
    "ABBA",
    "BABA",
    "CENTURY",
    "CITIES",
    "GREATER_THAN",
    "NAMES",
    "NOUNS",
    "OBJECTS",
    "PLACES",
    "SEPARATORS",
    "TASKS",
    "PairMetric",
    "TaskPairs",
    "greater_than",
    "induction",
    "ioi",
    "ioi_prompts",
    "mean_logprob",
    "retrieval",
    "signed_prob",
    "task",
]
