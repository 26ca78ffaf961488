"""``consumer dlq``: the dead-letter queue's tools."""
