"""This package's version: setup.py reads it from here, the commands print it (``--version``)."""

__version__ = "0.2.0"
