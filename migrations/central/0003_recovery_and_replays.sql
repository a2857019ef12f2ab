-- A create's request fingerprint and first response stay on its row, so that a retry of the
-- identical create without a key (a client that never got the answer) replays that response,
-- token included, whichever path settled the create. Replays are promised for 24 hours, like
-- idempotency keys; the purge then clears the columns.
ALTER TABLE dedicated_inferences
    ADD COLUMN create_fingerprint bytea,
    ADD COLUMN create_status_code integer,
    ADD COLUMN create_response bytea;
UPDATE dedicated_inferences d SET create_fingerprint = p.fingerprint
    FROM pending_creates p WHERE p.di_id = d.id;
ALTER TABLE pending_creates DROP COLUMN fingerprint;
CREATE INDEX dedicated_inferences_create_replies ON dedicated_inferences (created_at)
    WHERE create_response IS NOT NULL;

-- Recovery backs off per create and per keyed operation: failed attempts so far, and when to try
-- again (NULL: as soon as it is old enough).
ALTER TABLE pending_creates
    ADD COLUMN attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN retry_at timestamptz;

-- What a keyed PATCH, DELETE or token call sends to its region, sealed (it may carry a Hugging
-- Face token or a minted token value), so that the operation can be driven to its end after a
-- cut connection or a restart.
ALTER TABLE idempotency_keys
    ADD COLUMN sealed_operation bytea,
    ADD COLUMN attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN retry_at timestamptz;
CREATE INDEX idempotency_keys_unfinished_operations ON idempotency_keys (created_at)
    WHERE sealed_operation IS NOT NULL AND status_code IS NULL;
