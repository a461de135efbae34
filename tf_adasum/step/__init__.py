"""The helpers of one training step, below `AdasumOptimizer` and `SimulatedReplicas`.

Settings checked once, the Keras internals, the K-step state, the combine
(pairwise tree or AdaCons), the statistics the diagnostics callback reads,
and the replica loop of `SimulatedReplicas`.
"""
