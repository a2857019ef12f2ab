-- A keyed operation (patch, delete, token create or revoke) now names the DI it acts on, so that
-- what central keeps sealed about a DI (a minted token in a replayable response, a Hugging Face
-- token in an operation) is erased when the DI is gone. Keys from before this have none; they
-- are purged within a day as before.
ALTER TABLE idempotency_keys ADD COLUMN target_di_id uuid;
CREATE INDEX idempotency_keys_target ON idempotency_keys (target_di_id) WHERE target_di_id IS NOT NULL;
CREATE INDEX idempotency_keys_di ON idempotency_keys (di_id) WHERE di_id IS NOT NULL;
