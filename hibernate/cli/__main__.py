"""``python -m hibernate.cli``, the same as ``python -m hibernate`` and the ``hibernate`` command."""

from hibernate.cli.app import main

main()
