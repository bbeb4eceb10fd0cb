"""Subcommands that need the cache, generation and transfer layers (registered into `lynx-hf`)."""


def register(sub):
    pass
