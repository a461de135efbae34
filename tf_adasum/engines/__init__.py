"""How replicas reach each other: engines over transports (see `tf_adasum.engines.base`)."""
