"""rpmemfs: a FUSE filesystem of replicated persistent-memory files."""

__version__ = "0.1.0"
