"""Integrations with programs that put their own GPU memory to sleep (vLLM).

Each integration is imported only by the program it integrates with (through
that program's plugin mechanism), never by the CLI.
"""
