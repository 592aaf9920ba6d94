"""The base every process of a run imports: config errors and loading, the run's Redis namespace and
connection, the chaos fault hooks, and the process-side network/auth helpers.

The bottom layer: it imports no other project package and no torch (tests/unit/test_layers.py checks
both), so any package above may import it.
"""
