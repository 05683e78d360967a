"""The tuner (`python -m cluster.tune`): the search space, the search, the report."""
