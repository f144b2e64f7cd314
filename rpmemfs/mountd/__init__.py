"""The mount daemon and the admin side of a mount: options, the one function that assembles a
mount's layers (assemble.py), the daemon that serves them at a mountpoint, its control socket,
and making a pool together with its replicas."""
