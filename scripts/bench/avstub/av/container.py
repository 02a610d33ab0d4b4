from av import __getattr__  # noqa: F401 - see av/__init__.py
