"""Moved (0.3): ``idempotency_mw.urls`` is ``idempotency_mw.postgres._connector``, an internal of the package. Its
public names are imported from where its ``__getattr__`` says; importing them from here still works, with a
``DeprecationWarning``."""

from idempotency_mw._moved import moved

__getattr__ = moved(__name__, "idempotency_mw.postgres._connector", {"postgres_url": "idempotency_mw.postgres"})
