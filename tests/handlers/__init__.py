"""Handlers that only tests load (through ``CONSUMER_HANDLERS``), never product code."""
