"""``hibernate serve``: a reverse proxy that sleeps idle model servers and wakes them on a request.

    config.py      flags and serve.toml, parsed and checked (pure)
    routing.py     path prefix or ``model`` field -> backend (pure)
    backends.py    each backend's state and transitions; idle and budget decisions (pure parts)
    hibernator.py  the engine of ``hibernate sleep/wake/recover/status``, one backend at a time
    discovery.py   the process behind a backend's port
    metrics.py     /metrics (prometheus-client)
    proxy.py       the aiohttp server and client
    server.py      start, adopt, serve, stop

Everything but config.py and routing.py needs the ``serve`` extra (aiohttp,
prometheus-client); the CLI imports this package only for ``hibernate serve``.
"""
