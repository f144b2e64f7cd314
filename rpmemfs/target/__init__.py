"""The replica-node daemon: serves pools under a directory to rpmemfs initiators."""

from rpmemfs.target.cli import main

__all__ = ["main"]
