"""Integrations with programs that put their own GPU memory to sleep (vLLM).

``vllm.py`` (the sleep-mode backend and plugin) and ``self_checkpoint.py``
run inside the program, imported through its plugin mechanism; the CLI never
imports them (they import vLLM). ``vllm_server.py`` and ``vllm_flow.py`` are
the CLI's side, standard library only: they drive a running vLLM server
through its HTTP endpoints and its processes' agents.
"""
