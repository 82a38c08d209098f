"""Circuits: how heads work together, edge by edge (``headlab circuit``; docs/circuits.md).

- :func:`graph`: the component graph of a served model (input, heads, MLPs, logits; a head's q, k and v inputs as
  separate receivers), named as in Hanna et al. 2024's EAP-IG code (``a0.h1->a3.h2<q>``).
- :func:`edge_patch`: exact edge patching, the ground truth; :func:`patched_metric`: a set of edges at once.
- :func:`edge_scores`: every edge scored by EAP (Syed et al. 2023), EAP-IG (Hanna et al. 2024) or exactly.
- :func:`discover`: a circuit by top-n edges, greedy growth or ACDC (Conmy et al. 2023); :class:`Circuit`.
- :func:`faithfulness`: the circuit's metric against the full model and the empty circuit along circuit sizes,
  MIB's CPR and CMD (Mueller et al. 2025), random circuits as a baseline, the spread across templates.
- :func:`self_repair`: each head's direct against total effect and the heads that compensate (Rushing and Nanda
  2024), with a verdict per head.
- :func:`task`: clean/corrupted pairs and metrics for IOI, greater-than, induction and retrieval.
"""

from headlab.interpret.circuits.circuit import Circuit
from headlab.interpret.circuits.discovery import discover
from headlab.interpret.circuits.eap import edge_scores
from headlab.interpret.circuits.evaluation import faithfulness
from headlab.interpret.circuits.faithfulness_result import Faithfulness
from headlab.interpret.circuits.graph import Graph, Receiver, graph
from headlab.interpret.circuits.patching import ABLATIONS, ablated_outputs, edge_patch, patched_metric
from headlab.interpret.circuits.result import EdgeScores
from headlab.interpret.circuits.selfrepair import SelfRepair, self_repair
from headlab.interpret.circuits.tasks import TASKS, TaskPairs, task

__all__ = [
    "ABLATIONS",
    "TASKS",
    "Circuit",
    "EdgeScores",
    "Faithfulness",
    "Graph",
    "Receiver",
    "SelfRepair",
    "TaskPairs",
    "ablated_outputs",
    "discover",
    "edge_patch",
    "edge_scores",
    "faithfulness",
    "graph",
    "patched_metric",
    "self_repair",
    "task",
]
