"""Adapters: each wraps one real thing (Dynamo, vLLM, Ray, HTTP, torch.distributed) behind a port.

Adapters never import each other nor the wiring; heavy libraries are imported inside the
adapter that needs them, so importing one adapter never loads another's dependencies.
"""
