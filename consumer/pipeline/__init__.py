"""From a delivery to a verdict: prepare, apply in a transaction, judge."""
