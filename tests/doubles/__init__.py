"""Test doubles: the simulated S3 (``simulated``), the S3 fault proxy and failing store
(``faults``), and ``ckptd serve`` with slowed stores (``slow_serve``)."""
