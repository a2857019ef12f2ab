-- Central sends an operation id with every PATCH, DELETE and token create or revoke, and may send
-- the same operation again when it never heard the answer (a cut connection, a timeout, a
-- restart). The region records the id in the transaction that applies the operation, so a repeat
-- is answered with the current state instead of being applied twice. Central re-drives an
-- operation for at most 24 hours; rows are purged after two days.
CREATE TABLE applied_operations (
    operation_id uuid PRIMARY KEY,
    di_id        uuid NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX applied_operations_age ON applied_operations (created_at);
