-- A team's own quotas in this region, where an operator set them (`regional quota set`); NULL,
-- or a size absent from gpus_per_size (size slug -> GPUs), means the service's default (its
-- QUOTA_* settings). What a team holds is not stored: it is counted from its live DIs, under a
-- per-team advisory lock, by every create and patch (region-store's quotas module).
CREATE TABLE team_quotas (
    team_id              uuid PRIMARY KEY,
    dedicated_inferences integer CHECK (dedicated_inferences >= 0),
    gpus                 integer CHECK (gpus >= 0),
    gpus_per_size        jsonb NOT NULL DEFAULT '{}',
    updated_at           timestamptz NOT NULL DEFAULT now()
);
