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

Words, each with one meaning:

    step     one declared action of an operation (lock, quiesce, spill, cuda, ...): shown, journaled,
             given a fault point, undone on failure
    label    how progress shows a step (``spill``, ``vllm-sleep 1234``)
    mark     a journal's record that a step completed (``phases`` in the journal's file)
    answer   what an agent returned for one request (its own timings, bytes moved)
    stage    the CUDA stage (:mod:`.cuda`): the steps cuda-lock, cuda and cuda-restore over every
             CUDA holder of every target
    group checkpoint  what the stage asks of :mod:`hibernate.checkpoint.group`: lock all,
             checkpoint all; restore all, unlock all, undone together

The JSON reports keep the key ``phases`` for the seconds of each step.

The same rule over the whole package: a word names one thing in code, whatever
older words the wire, the JSON documents, the flags or serve.toml keep.

    kind         a kind of target (:mod:`.registry`: ``agent``, ``vLLM``), named by an agent's
                 ``sleep_driver``; never what the program runs on
    runtime      what a target's program runs on (``torch``, ``vllm``): the wire key ``kind``,
                 ``Agent.runtime`` in the agent; a *runtime directory* is another thing:
                 where agents' sockets and journals live (:mod:`hibernate.agent.paths`)
    snapshot     memory written to disk: ``snap-N`` under a spill root, with its manifest; never a
                 reading of the GPUs (a ``DeviceReading``, :func:`hibernate.checkpoint.nvml.read_gpus`)
    spill root   one process's directory of snapshots (:mod:`hibernate.store.layout`), under the
                 ``--to`` directory
    directory    where a request's snapshots go: the wire key ``dir``
    awake        a target (or a serve backend) whose memory is on the GPU; an agent's state says
                 ``running`` (``AgentState.RUNNING``, the wire's word), serve's states ``awake``
    running      a process that exists (started, not exited); for awake, only in ``AgentState``
    idle limit   how long serve lets a backend go unused before it puts it to sleep (``--idle``, a
                 backend's ``idle``, a request's keep-alive in its place): ``idle_limit``
    sleep candidates  the awake backends with nothing in flight that serve may put to sleep
    transition outcome  how one of serve's starts, wakes or sleeps ended (``TransitionOutcome``)
    call result  how one call run by :mod:`hibernate.threads` ended: value or error, and seconds
    silence timeout  how long a client waits for an agent's next message, not for its whole answer
                 (``AgentClient.call``); serve's ``[limits] idle_timeout`` closes a client's
                 connection that sends no whole request

An agent's status and state are read through :mod:`hibernate.agent.wire` (``AgentStatus``,
``AgentState``), never as words. There a *kind* is only a kind of target (the registry's
``agent``, ``vLLM``, which an agent names as its ``sleep_driver``): what the wire key ``kind``
holds (``torch``, ``vllm``: what the program runs on) is ``AgentStatus.runtime`` in code.

    engine     sleep, wake, recover and status over any set of targets, as one unit
    steps      steps declared as data, and the one runner that does them
    unit       agents of one kind that move as one; what every kind must say about itself
    registry   kinds of target, registered by name, loaded when met
    targets    from pids to process trees, the agents in them and the CUDA holders
    cuda       the CUDA stage
    ledger     one operation's locks and journal entries
    journal    the journal files and the per-target lock that survive a killed command
    recovery   the one table of what an interrupted operation needs
    options    what a caller may choose about one operation
    progress   the sink a caller gets step labels, byte counts and notes on
    reports    what a sleep, wake or recover reports, typed, and its JSON
"""
