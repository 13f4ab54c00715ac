"""``hibernate serve``: a reverse proxy that sleeps idle model servers and wakes them on a request.

    config.py      flags and serve.toml, parsed and checked (pure)
    routing.py     path prefix or ``model`` field -> backend (pure)
    decisions.py   which backend to put to sleep, and when: past its idle time, or to fit the budget (pure)
    backends.py    each backend's state and the transitions that change it, acting on those decisions
    control.py     what serve does to a backend: the engine of ``hibernate sleep/wake/recover/status``
    discovery.py   the process behind a backend's address (the listening socket a connection reaches)
    leases.py      a forwarded request holds its backend awake: leases on its agents, over open links
    metrics.py     /metrics (prometheus-client)
    httplog.py     a request aiohttp could not serve: one log line, never a traceback, rate-limited
    proxy.py       the aiohttp server and client
    server.py      start, adopt, serve, stop

Everything but config.py and routing.py needs the ``serve`` extra (aiohttp,
prometheus-client); the CLI imports this package only for ``hibernate serve``.
"""
