"""Benchmark harness: the service against Celery, Dramatiq and the machine's limits; a soak.

``make bench`` / ``python -m bench run`` and ``make soak`` / ``python -m bench soak``; see
``bench/README.md``.
"""
