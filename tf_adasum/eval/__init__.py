"""The scaling evaluation: epochs to a target accuracy, Adasum against averaging.

Run it with `tf-adasum eval` (or `python -m tf_adasum.eval`, or `make eval` for
the quick preset); see `tf_adasum.eval.cli`.
"""
