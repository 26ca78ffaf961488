"""An example team's billing handlers for rabbit-pg-consumer (``billing.handlers``)."""
