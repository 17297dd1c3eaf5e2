"""What vLLM's layerwise reload alone adds to a CPU worker's memory (no transfer, no receiver).

    unshare -n sh -c 'ip link set lo up && VLLM_ALLOW_INSECURE_SERIALIZATION=1 \\
        .venv/bin/python bench/probe_reload_memory.py MODEL_DIR'

Starts vLLM (offline ``LLM``) on a local model folder and, inside its worker, reloads the
weights three times from a state dict already in memory (``clone``: a fresh tensor per weight,
as a transfer hands them over; ``view``: the same tensors each time): RSS growth at the peak
(sampled every 5 ms) and after, before and after ``malloc_trim(0)``, plus the smaps rollup.
"""

from __future__ import annotations

import os



def probe(self, path: str, mode: str) -> list:
    import ctypes
    import gc
    import threading
    import time

    import psutil
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    process, libc = psutil.Process(), ctypes.CDLL("libc.so.6")
    model, config = self.model_runner.model, self.model_runner.model_config
    state = {name: t.clone() for name, t in load_file(path).items()}  # anonymous memory
    report = []
    for rep in range(3):
        gc.collect()
        libc.malloc_trim(0)
        base = process.memory_info().rss
        peak, done = [base], threading.Event()

        def sample():
            while not done.wait(0.005):
                peak[0] = max(peak[0], process.memory_info().rss)

        sampler = threading.Thread(target=sample)
        sampler.start()
        initialize_layerwise_reload(model)
        model.load_weights((n, t.clone() if mode == "clone" else t) for n, t in state.items())
        finalize_layerwise_reload(model, config)
        done.set()
        sampler.join()
        after = process.memory_info().rss
        started = time.perf_counter()
        libc.malloc_trim(0)
        trim_s = time.perf_counter() - started
        trimmed = process.memory_info().rss
        report.append(f"reload {rep + 1}: peak {(peak[0] - base) / 2**20:+.0f} MiB, after"
                      f" {(after - base) / 2**20:+.0f} MiB, after malloc_trim"
                      f" {(trimmed - base) / 2**20:+.0f} MiB (trim {trim_s * 1e3:.1f} ms)")
    return report


def main() -> None:
    from vllm import LLM

    import argparse

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a local model folder with model.safetensors")
    model = parser.parse_args().model
    llm = LLM(model=model, max_model_len=256, enforce_eager=True, dtype="float32",
              kv_cache_memory_bytes=64 << 20)
    for mode in ("clone", "view"):
        for line in llm.collective_rpc(probe, args=(os.path.join(model, "model.safetensors"), mode))[0]:
            print(f"{mode}: {line}", flush=True)


if __name__ == "__main__":
    main()
