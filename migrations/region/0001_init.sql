-- Desired state of one region: dedicated inferences, their immutable spec versions, tokens,
-- encrypted provider secrets, per-DI certificate authorities, events and the change outbox.

CREATE TABLE dedicated_inferences (
    id                     uuid PRIMARY KEY,
    team_id                uuid NOT NULL,
    region                 text NOT NULL,
    vpc_uuid               uuid NOT NULL,
    enable_public_endpoint boolean NOT NULL,
    status                 text NOT NULL CHECK (status IN ('new','provisioning','active','updating','deleting','error')),
    status_reason          text,
    current_version        integer,
    pending_version        integer,
    public_endpoint_fqdn   text,
    private_endpoint_fqdn  text,
    created_at             timestamptz NOT NULL DEFAULT now(),
    updated_at             timestamptz NOT NULL DEFAULT now(),
    -- Set when every cloud resource is gone; the row stays as a tombstone so that a late retry of
    -- the create that made it cannot bring it back.
    gone_at                timestamptz
);
CREATE INDEX dedicated_inferences_team ON dedicated_inferences (team_id) WHERE gone_at IS NULL;

-- Every accepted create or patch is a new, immutable row.
CREATE TABLE spec_versions (
    di_id                  uuid NOT NULL REFERENCES dedicated_inferences (id),
    version                integer NOT NULL CHECK (version >= 1),
    id                     uuid NOT NULL UNIQUE,
    name                   text NOT NULL,
    enable_public_endpoint boolean NOT NULL,
    vpc_uuid               uuid NOT NULL,
    created_at             timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (di_id, version)
);

CREATE TABLE model_deployments (
    di_id           uuid NOT NULL,
    version         integer NOT NULL,
    position        integer NOT NULL,
    model_id        uuid NOT NULL,
    model_slug      text NOT NULL,
    model_provider  text NOT NULL,
    workload_config jsonb NOT NULL DEFAULT '{}',
    PRIMARY KEY (di_id, version, position),
    FOREIGN KEY (di_id, version) REFERENCES spec_versions (di_id, version)
);

CREATE TABLE accelerator_groups (
    di_id               uuid NOT NULL,
    version             integer NOT NULL,
    deployment_position integer NOT NULL,
    position            integer NOT NULL,
    accelerator_slug    text NOT NULL,
    role                text NOT NULL,
    scale               integer NOT NULL CHECK (scale >= 1),
    PRIMARY KEY (di_id, version, deployment_position, position),
    FOREIGN KEY (di_id, version, deployment_position) REFERENCES model_deployments (di_id, version, position)
);

-- Accelerators as observed by the workers (the real nodes behind the node pools).
CREATE TABLE accelerators (
    id         uuid PRIMARY KEY,
    di_id      uuid NOT NULL REFERENCES dedicated_inferences (id),
    name       text NOT NULL,
    slug       text NOT NULL,
    role       text NOT NULL,
    status     text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (di_id, name)
);

-- Only a hash of each token value is kept.
CREATE TABLE access_tokens (
    id         uuid PRIMARY KEY,
    di_id      uuid NOT NULL REFERENCES dedicated_inferences (id),
    name       text NOT NULL,
    token_hash bytea NOT NULL UNIQUE,
    is_managed boolean NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);
CREATE INDEX access_tokens_di ON access_tokens (di_id, created_at) WHERE revoked_at IS NULL;

-- Provider credentials (the Hugging Face token), AES-GCM encrypted under a key from configuration.
CREATE TABLE provider_secrets (
    di_id      uuid NOT NULL REFERENCES dedicated_inferences (id),
    kind       text NOT NULL,
    sealed     bytea NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (di_id, kind)
);

-- The CA that signs each endpoint's TLS certificate; its private key is sealed like the secrets.
CREATE TABLE certificate_authorities (
    di_id      uuid PRIMARY KEY REFERENCES dedicated_inferences (id),
    cert_pem   text NOT NULL,
    key_sealed bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE events (
    id         bigserial PRIMARY KEY,
    di_id      uuid NOT NULL REFERENCES dedicated_inferences (id),
    phase      text NOT NULL,
    reason     text NOT NULL,
    message    text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX events_di ON events (di_id, id);

-- One row per committed change of a dedicated inference. Consumers read the DI's current state, so
-- the row carries no payload; `seq` orders changes and lets a consumer resume.
CREATE TABLE outbox (
    seq        bigserial PRIMARY KEY,
    di_id      uuid NOT NULL REFERENCES dedicated_inferences (id),
    kind       text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('di_changes', NEW.di_id::text);
    RETURN NEW;
END $$;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION outbox_notify();
CREATE INDEX outbox_di ON outbox (di_id, seq);
