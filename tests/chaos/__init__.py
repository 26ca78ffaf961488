"""The chaos suite: real consumer processes under real faults, checked from the database and queues.

``python -m tests.chaos --profile short|long`` (``make chaos``); see ``tests/chaos/README.md``.
"""
