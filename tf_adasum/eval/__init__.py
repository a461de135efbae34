"""The scaling evaluation (epochs to target accuracy, Adasum against averaging).

Not built yet: see the project's issue "The scaling evaluation".
"""
