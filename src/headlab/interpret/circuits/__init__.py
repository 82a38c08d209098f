"""Circuits: how heads work together, edge by edge.

- :func:`graph`: the component graph of a served model (input, heads, MLPs, logits; a head's q, k and v inputs as
  separate receivers), named as in Hanna et al. 2024's EAP-IG code (``a0.h1->a3.h2<q>``).
- :func:`edge_patch`: exact edge patching, the ground truth; :func:`patched_metric`: a set of edges at once.
- :func:`edge_scores`: every edge scored by EAP (Syed et al. 2023), EAP-IG (Hanna et al. 2024) or exactly.
"""

from headlab.interpret.circuits.eap import edge_scores
from headlab.interpret.circuits.graph import Graph, Receiver, graph
from headlab.interpret.circuits.patching import ABLATIONS, ablated_outputs, edge_patch, patched_metric
from headlab.interpret.circuits.result import EdgeScores

__all__ = ["ABLATIONS", "EdgeScores", "Graph", "Receiver", "ablated_outputs", "edge_patch", "edge_scores", "graph",
           "patched_metric"]
