"""PostgreSQL: the pool, the receipts and their partitions, crash marks, migrations."""
