"""Each bench run's own prompts.

An engine with prefix caching skips the prefill of a prompt it has already seen, so a run that
re-sends an earlier run's prompts times less work than the first did. ``vllm bench serve``'s
random prompts are a function of its ``--seed`` and the count alone (the first 64 of 256 are
the 64 of a 64-prompt run of the same lengths), and so are the benches' own random token IDs:
every run names its seed from what identifies it (shape, round, way), and servers compared
like for like get the same one.
"""

from __future__ import annotations

import zlib


def prompt_seed(*run) -> int:
    """A seed for the run named by ``run`` (e.g. its shape and round): the same name, the same
    seed, on any machine and in any process; another name, another seed."""
    return zlib.crc32(" ".join(map(str, run)).encode())
