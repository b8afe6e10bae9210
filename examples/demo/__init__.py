"""The payments demo: the payments example behind a lossy network, driven by a client that keeps retrying.

- ``run``: ``./dev demo`` (``python -m examples.demo``), which serves ``examples.payments.app`` in a child process
  (``faults.server``), puts ``faults.proxy.LossyProxy`` in front of it, and checks that nothing ran twice;
- ``workload``: the logical payments and what the client believes happened;
- ``audit``: that belief held against the ledger.
"""
