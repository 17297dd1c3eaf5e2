"""The pure core of rollout-fleet: values, rules and services written against ports.

Imports only the standard library and attrs (a test enforces it), so it works on
any machine and starts fast.
"""
