"""The kinds of target this hibernate knows: one registration line each.

A flow is a :class:`hibernate.operation.unit.Unit` subclass in a module of its
own, loaded only when a target of its kind is met. Adding a kind is that
module plus one line here.

    agents     plain agents: processes whose own agent moves their tagged pools
    vllm       a vLLM server: its own endpoints move the workers' memory (one unit per server): the
               steps, their order and their undo
    vllm_processes  the server's processes through their agents: found from any pid, polled, checked
               before a sleep, woken directly where vLLM cannot
    vllm_rules the pure rules: which agents are workers, --level and --drain, what counts as progress
    vllm_api   talking to a running vLLM server: where it listens, its sleep endpoints (stdlib only)
    members    the connections to the agents taking part in an operation, shared by the flows
"""

from hibernate.integrations import VLLM_KIND
from hibernate.operation.registry import PLAIN, register_flow

register_flow(PLAIN, "hibernate.flows.agents:AgentsUnit")
register_flow(
    VLLM_KIND,
    "hibernate.flows.vllm:VllmServerUnit",
    options=("level", "drain", "vllm_url"),
    noun="a vLLM server",
)
