"""The broker's plan as data: the exchanges, queues and bindings a service needs, and the one
declarer that applies them. Knows nothing of the service (it never imports ``consumer``)."""
