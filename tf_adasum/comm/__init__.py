"""Transports for the vector-halving driver (`tf_adasum.rvh.Communicator`).

`collective`: TensorFlow collective ops, for the devices of one process and for
worker processes of a TF cluster.
"""
