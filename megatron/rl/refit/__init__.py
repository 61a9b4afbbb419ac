"""Refit: the trained weights copied into an inference copy of the model on another layout.

``tensor_parallel.py``: how a parameter is split over tensor-parallel ranks and how one layout's
shards become another's; ``collocated.py``: ``CollocatedRefit``, the copy every rank makes after an
optimizer step into its own inference copy.
"""
