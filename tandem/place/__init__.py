"""Placement of models on cells: FineServe's global scheduler (``tandem place``)."""
