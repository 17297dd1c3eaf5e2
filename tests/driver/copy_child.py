"""Run in a child process: unpickle a FleetGeneration, generate, invalidate caches, report.

stdin: the pickled driver and a batch; stdout: a pickled report. Used by the driver tests to
show that a pickled copy works in another process, as a Ray rollout actor would use it.
"""

from __future__ import annotations

import asyncio
import pickle
import sys


async def generate_all(generation, data):
    return sorted([(i, {k: v.tolist() for k, v in sample.items()})
                   async for i, sample in generation.generate_async(data, greedy=True)],
                  key=lambda pair: pair[0])


def main() -> None:
    generation, data = pickle.loads(sys.stdin.buffer.read())
    samples = asyncio.run(generate_all(generation, data))
    invalidated = generation.invalidate_kv_cache()
    report = {"is_copy": generation.is_copy, "samples": samples, "invalidated": invalidated,
              "shutdown": generation.shutdown()}
    sys.stdout.buffer.write(pickle.dumps(report))


if __name__ == "__main__":
    main()
