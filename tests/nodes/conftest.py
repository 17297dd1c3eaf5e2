"""The nodes tier: a real multi-node Ray cluster on one machine, each node a network namespace
of its own (support/node_layout.py). It needs root (namespaces, a bridge) and `ip`."""
