-- Which outbox entries record a change a customer asked for (create, patch, delete, token changes).
-- Only those make a DI due for a worker before its `next_check_after`: a worker's own progress
-- (provisioning begun, rollout complete, an event) must not send the DI straight back to the
-- queue for a pass that would find nothing new. Existing entries count as requested, which at
-- worst costs one extra pass.
ALTER TABLE outbox ADD COLUMN requested boolean NOT NULL DEFAULT true;
ALTER TABLE outbox ALTER COLUMN requested SET DEFAULT false;
CREATE INDEX outbox_requested ON outbox (di_id, seq) WHERE requested;

-- Workers listen on their own channel, which carries only requested changes: a worker's own
-- progress would otherwise wake every worker of the region for a claim that finds nothing.
-- `di_changes` still carries every change (the change feed that central follows).
CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('di_changes', NEW.di_id::text);
    IF NEW.requested THEN
        PERFORM pg_notify('di_work', NEW.di_id::text);
    END IF;
    RETURN NEW;
END $$;
