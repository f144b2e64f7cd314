"""The mount daemon and the admin side of a mount: options, the daemon that serves a pool at a
mountpoint, its control socket, and making a pool together with its replicas."""
