"""Adasum's tree over any transport: the vector-halving algorithm (ADASUMRVH,
`rvh`), the interface it asks of a transport (`communicator`), which ranks
meet at which level (`topology`), how one process's ranks reach their
partners (`exchanges`), and the bucket fusion of its buffers (`buckets`)."""
