-- Exactly what the reference handlers do, for the run-time role consumer_app (made, or checked,
-- by the service's own set, which runs first).
--   stock: upsert on restock, conditional UPDATE ... RETURNING on reserve, SELECT on refusal.
GRANT SELECT, INSERT, UPDATE ON stock TO consumer_app;
--   stock_movements: INSERT ... RETURNING id (the identity needs no sequence grant).
GRANT SELECT, INSERT ON stock_movements TO consumer_app;
--   notifications: INSERT only; the sender that marks them sent is another role's business.
GRANT INSERT ON notifications TO consumer_app;
