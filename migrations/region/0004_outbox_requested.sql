-- Which outbox entries record a change a customer asked for (create, patch, delete, token changes).
-- Only those make a DI due for a worker before its `next_check_after`: a worker's own progress
-- (provisioning begun, rollout complete, an event) must not send the DI straight back to the
-- queue for a pass that would find nothing new. Existing entries count as requested, which at
-- worst costs one extra pass.
ALTER TABLE outbox ADD COLUMN requested boolean NOT NULL DEFAULT true;
ALTER TABLE outbox ALTER COLUMN requested SET DEFAULT false;
CREATE INDEX outbox_requested ON outbox (di_id, seq) WHERE requested;
