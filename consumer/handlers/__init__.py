"""The reference handlers: an order's stock deduction and its notification.

Each module is one ``CONSUMER_HANDLERS`` entry; a deployment lists its own modules instead
or as well.
"""
