"""Real backends of the control plane (§4): a worker on every torchrun rank drives vLLM engines, the GRPO
trainer and GPS for its device; the controller on rank 0 talks to the workers over a message bus.

Among its modules: ``messages`` (the JSON control messages; no torch), ``bus`` (ZeroMQ sockets carrying
them), ``worker`` (the per-rank loop serving one role at a time). Importing this package imports no
torch or vLLM; import the modules themselves.
"""
