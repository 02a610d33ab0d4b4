from av import __getattr__  # noqa: F401
