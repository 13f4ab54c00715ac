"""The agent: a state machine inside the target process, and how it is reached from outside.

Inside the target (loaded by ``import hibernate`` in the program, never by the CLI):

    local       this process's one agent, created on first use with its control socket
    controller  the agent's state machine: what this process's memory is doing, and who may change it
    server      the control socket, served from daemon threads
    guard       a program's promise not to touch tracked memory while hibernate moves it
    leases      requests in flight through ``hibernate serve`` that hold this process awake
    signals     a scheduler's warning signal puts the process to sleep
    crash       last words of a process that dies while its memory comes back

Both sides (standard library only):

    paths       where agents listen: one socket per process in a private runtime directory
    protocol    the wire protocol: length-prefixed JSON over a Unix stream socket
    wire        what travels on it, typed: the agent's state and status, each request's arguments
    client      talking to an agent from outside its process (the CLI, the engine, serve)
    triggers    which signals may put a process to sleep or wake it, and the variables carrying them

Importing this package loads nothing: ``tests/test_layers.py`` checks that the
in-target modules import nothing from the CLI side, and ``tests/test_cli_light.py``
that the CLI never loads the in-target ones.
"""
