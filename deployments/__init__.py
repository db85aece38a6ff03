"""Ray Serve deployments: thin wrappers over the plain classes in `ninfer/` (see app.py for the graph)."""
