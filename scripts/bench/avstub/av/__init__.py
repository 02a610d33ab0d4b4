"""A stand-in for PyAV on the benchmark machine ONLY (never shipped to users, never used by tests).

ComfyUI imports `av` at module level in several files; the latent-only benchmark workflow never encodes or
decodes media, and the device machine cannot install PyAV. Every attribute is an inert object.
"""


class _Stub:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __getattr__(self, name):
        return _Stub()

    def __iter__(self):
        return iter(())

    def __mro_entries__(self, bases):
        return (object,)


def __getattr__(name):
    return _Stub()
