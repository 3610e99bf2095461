"""The ``a3po`` command line (``python -m cli``, or the ``a3po`` console script): the top of the
stack, above ``bench``, ``flows``, ``tasks``, ``eval`` | ``infra`` and the library ``a3po``.
``cli.dispatch`` holds the subcommands; ``a3po train`` itself is the library's
``a3po.training.command``."""

from cli.dispatch import COMMANDS, Command, main

__all__ = ["COMMANDS", "Command", "main"]
