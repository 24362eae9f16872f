"""The LongCE comparison experiment (``longppl-reproduce-longce``; :mod:`.pipeline` describes its stages
and files). ``cli`` and ``main`` are its command's."""

from .pipeline import cli, main

__all__ = ["cli", "main"]
