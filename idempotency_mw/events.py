"""Moved (0.3): ``idempotency_mw.events`` is ``idempotency_mw._events``, an internal of the package. Its public names
are imported from where its ``__getattr__`` says; importing them from here still works, with a
``DeprecationWarning``."""

from idempotency_mw._moved import moved

__getattr__ = moved(
    __name__,
    "idempotency_mw._events",
    {"log_event": "idempotency_mw", "Event": "idempotency_mw", "Outcome": "idempotency_mw"},
)
