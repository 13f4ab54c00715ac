"""The version, in a module of its own: the agent reports it without importing the package's face."""

__version__ = "0.1.0"
