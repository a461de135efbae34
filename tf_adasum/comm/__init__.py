"""Transports for the vector-halving driver (`tf_adasum.tree.rvh.Communicator`).

`collective`: TensorFlow collective ops, for the devices of one process, GPUs,
and worker processes of a TF cluster; `sockets`: TCP connections of our own
between the CPU worker processes of a TF cluster; `mpi`: mpi4py, for jobs
started by ``mpirun`` (the tree's steps over it: `mpi_communicator`; over the
sockets: `socket_communicator`, with `socket_listener` serving the port).
Beside them: `cluster` (which devices and processes a strategy spans),
`compression` (a wire format over any of them), `ordering` (program order for
the transports whose steps are ``tf.numpy_function`` calls).
"""
