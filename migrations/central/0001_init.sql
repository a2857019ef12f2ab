-- Central's own state: API tokens, the ownership map with its read model of every dedicated
-- inference, pending creates (for exactly-once recovery), idempotency records and feed cursors.

CREATE TABLE api_tokens (
    id                  uuid PRIMARY KEY,
    team_id             uuid NOT NULL,
    name                text NOT NULL,
    token_hash          bytea NOT NULL UNIQUE,
    scopes              text[] NOT NULL,
    rate_limit_per_hour integer,
    created_at          timestamptz NOT NULL DEFAULT now(),
    revoked_at          timestamptz
);

-- Ownership map (id -> team, region) and read model in one row. `body` is the region's last
-- snapshot, `region_seq` the outbox position it came from (older snapshots never overwrite newer).
-- `state`: 'pending' while a create is not yet confirmed by the region, 'live', 'gone'.
CREATE TABLE dedicated_inferences (
    id         uuid PRIMARY KEY,
    team_id    uuid NOT NULL,
    region     text NOT NULL,
    name       text NOT NULL,
    state      text NOT NULL CHECK (state IN ('pending','live','gone')),
    status     text NOT NULL,
    body       jsonb,
    region_seq bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
-- Names are unique per team among DIs that are neither gone nor being deleted.
CREATE UNIQUE INDEX dedicated_inferences_team_name ON dedicated_inferences (team_id, name)
    WHERE state <> 'gone' AND status <> 'deleting';
CREATE INDEX dedicated_inferences_team_list ON dedicated_inferences (team_id, created_at, id)
    WHERE state = 'live';

-- What a create needs to be re-driven after a crash: the request as the region will receive it,
-- with its secrets sealed.
CREATE TABLE pending_creates (
    di_id       uuid PRIMARY KEY REFERENCES dedicated_inferences (id),
    fingerprint bytea NOT NULL,
    sealed      bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE idempotency_keys (
    team_id     uuid NOT NULL,
    key         text NOT NULL,
    fingerprint bytea NOT NULL,
    di_id       uuid,
    status_code integer,
    sealed_body bytea,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (team_id, key)
);
CREATE INDEX idempotency_keys_age ON idempotency_keys (created_at);

CREATE TABLE region_cursors (
    region   text PRIMARY KEY,
    last_seq bigint NOT NULL
);
