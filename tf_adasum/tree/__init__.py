"""Adasum's tree over any transport: the vector-halving algorithm (ADASUMRVH,
`rvh`) and the bucket fusion of its buffers (`buckets`)."""
