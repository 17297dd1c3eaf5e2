"""What vLLM runs inside its own worker processes: the project's weight-transfer engines
(packed, sharded, colocated) and the worker extension. Nothing here is imported by the host."""
