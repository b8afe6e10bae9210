"""The fault harness: scenarios that break the middleware's surroundings on purpose, and the soak command.

Each scenario module runs one kind of fault against real processes and a real PostgreSQL and returns a
:class:`faults.report.Result`; ``tests/faults`` runs them small and asserts on the results, ``python -m faults.soak``
runs them long and publishes the table in ``docs/faults.md``.
"""
