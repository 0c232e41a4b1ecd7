"""kvloop's version, written once: the package, the CLI and the API server read it here."""

__version__ = "0.1.0"
