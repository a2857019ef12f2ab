-- The workers' queue and teardown ledger.
--
-- `work_items` has one row per dedicated inference (created with it): who holds its lease, until
-- when, and when it should next be looked at. A DI is claimable when no live lease holds it and it
-- needs work (a status a worker moves forward, a pending spec, or a periodic resync of an active
-- DI) and either its `next_check_after` has passed or it changed since a worker last looked
-- (its newest outbox entry is past `seen_seq`). `error` DIs are not claimed: a new spec version or
-- a delete moves them out of `error`.
CREATE TABLE work_items (
    di_id            uuid PRIMARY KEY REFERENCES dedicated_inferences (id),
    holder           text,
    lease_token      uuid,
    expires_at       timestamptz,
    next_check_after timestamptz NOT NULL DEFAULT '-infinity',
    seen_seq         bigint NOT NULL DEFAULT 0,
    checked_at       timestamptz,
    -- Stall detection: a fingerprint of what the DI is waiting for, since when it has not changed,
    -- and whether the stall was already reported as an event.
    progress_key     text,
    progress_since   timestamptz,
    stall_reported   boolean NOT NULL DEFAULT false
);
CREATE INDEX work_items_due ON work_items (next_check_after);

INSERT INTO work_items (di_id) SELECT id FROM dedicated_inferences WHERE gone_at IS NULL;

CREATE FUNCTION work_item_create() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO work_items (di_id) VALUES (NEW.id) ON CONFLICT DO NOTHING;
    RETURN NEW;
END $$;
CREATE TRIGGER work_item_create AFTER INSERT ON dedicated_inferences
    FOR EACH ROW EXECUTE FUNCTION work_item_create();

-- Every external resource a worker creates for a DI, recorded before (or as) it is created and
-- keyed by a name derived from our ids, so a crash between "create" and "remember" cannot leak
-- it. Delete walks a DI's entries newest first. `kind` is `cluster` (name = the VPC's cluster,
-- shared by the VPC's DIs), `node_pool` or `namespace` (scope = the cluster's name).
CREATE TABLE teardown_ledger (
    seq         bigserial PRIMARY KEY,
    di_id       uuid NOT NULL REFERENCES dedicated_inferences (id),
    kind        text NOT NULL CHECK (kind IN ('cluster', 'node_pool', 'namespace')),
    name        text NOT NULL,
    scope       text NOT NULL DEFAULT '',
    external_id text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (di_id, kind, name)
);
CREATE INDEX teardown_ledger_cluster ON teardown_ledger (kind, name);
