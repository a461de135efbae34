"""Adasum's tree over any transport: the vector-halving algorithm (ADASUMRVH) and bucket fusion."""
