"""The operation engine: one sleep, wake or recover over any set of targets.

A sleep or wake is a list of declared steps (:mod:`.steps`) run by one runner:
each step is shown, journaled (:mod:`.ledger`), given its fault point, and on
failure everything done is undone in reverse. The steps come from three places:

    lock, connect                        the engine, over every target
    each unit's own memory steps         its flow (a plain agent's quiesce/spill/release, ...)
    cuda-lock, cuda / cuda-restore, cuda one CUDA stage over every CUDA holder (:mod:`.cuda`)

A *flow* is registered by kind (:mod:`.registry`) and loaded only when a
target of its kind is met; it groups that kind's agents into *units*
(:mod:`.unit`: all plain agents, one vLLM server each). What an interrupted
operation left is decided by one table (:mod:`.recovery`). The engine knows no
kind of target by name: it never imports ``hibernate.integrations`` or the
flows; ``hibernate.orchestrator`` registers them and is what callers use.
"""
