"""Transports for the vector-halving driver (`tf_adasum.tree.communicator.Communicator`).

`collective`: TensorFlow collective ops, for the devices of one process, GPUs,
and worker processes of a TF cluster (their keys: `collective_keys`);
`sockets`: TCP connections of our own between the CPU worker processes of a
TF cluster (one connection: `socket_link`; the port: `socket_listener`; its
settings and set-up among the workers: `socket_setup`; the tree's steps over
it: `socket_communicator`); `mpi_transport`: mpi4py, for jobs started by
``mpirun`` (the tree's steps over it: `mpi_communicator`). Beside them:
`cluster` (which devices and processes a strategy spans), `compression` (a
wire format over any of them), `ordering` (program order for the transports
whose steps are ``tf.numpy_function`` calls). A transport knows nothing above
it: no engine, no optimizer, no launcher.
"""
