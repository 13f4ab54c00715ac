"""Integrations with programs that put their own GPU memory to sleep (vLLM).

``vllm.py`` (the sleep-mode backend and plugin, which imports vLLM) and
``self_checkpoint.py`` (its helper for HIBERNATE_SELF_CHECKPOINT=1) run inside
the program, loaded through its plugin mechanism; the CLI never imports them.
``vllm_server.py`` and ``vllm_flow.py`` are the CLI's side, standard library
only: they drive a running vLLM server through its HTTP endpoints and its
processes' agents.
"""

# The kind of target a vLLM process's agent names (its sleep driver); hibernate/flows registers it.
VLLM_KIND = "vLLM"
