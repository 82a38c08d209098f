"""Looking past the weights: value-aware norms, attention rollout and attention flow.

- :func:`~headlab.interpret.flow.norms.attention_norms` (Kobayashi et al. 2020, 2021)
- :func:`~headlab.interpret.flow.rollout.rollout` (Abnar and Zuidema 2020)
- :func:`~headlab.interpret.flow.maxflow.attention_flow` (Abnar and Zuidema 2020)
"""
