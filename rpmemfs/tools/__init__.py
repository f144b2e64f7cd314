"""Tools users run beside the product: bench, soak, demo, and starting and stopping our
processes for them and for the tests. The core (fs, pool, replica, transport, target, mountd)
never imports this package."""
