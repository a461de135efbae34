"""The helpers of one training step, below `AdasumOptimizer` and `SimulatedReplicas`.

Settings checked once, the Keras internals, the K-step state, the combine
(pairwise tree or AdaCons) and the statistics the diagnostics callback reads.
"""
