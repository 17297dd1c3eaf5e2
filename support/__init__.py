"""Helpers that both the tests and the benches use: model folders for the GPU runs, vLLM's own
benchmark client, the simulated nodes' network layout, a restated NeMo-RL trainer's senders.

The tests and the benches import from here; nothing here imports either of them, and the
benches import nothing from the tests (tests/unit/test_import_direction.py holds both)."""
