"""Code that runs inside a program that puts its own GPU memory to sleep (vLLM).

``vllm.py`` (the sleep-mode backend and plugin, which imports vLLM), with
``vllm_distributed.py`` (the workers' state shared across GPUs: its rules and
the vote that stops every worker when one fails), and
``self_checkpoint.py`` (a worker's side of HIBERNATE_SELF_CHECKPOINT=1: it starts
the helper, :mod:`hibernate.checkpoint.helper`, and orders its calls) are loaded
through the program's plugin mechanism; the CLI never imports them. The CLI's
side of a vLLM server (its HTTP endpoints, its flow) is in :mod:`hibernate.flows`.
"""

# The kind of target a vLLM process's agent names (its sleep driver); hibernate/flows registers it.
VLLM_KIND = "vLLM"
