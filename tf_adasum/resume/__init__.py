"""What a backup is made of: the files of its folder, and each replica's optimizer state.

Read and written by `tf_adasum.backup`.
"""
