-- Where a deployment's model comes from. `provider_model_id` is kept as the customer sent it
-- (godo sends "" when unset); `source_*` is what the model server loads: the catalog model's
-- repository, or the customer's own Hugging Face repository (`source_custom`) at an optional
-- revision. Before this, the model server loaded `model_slug` itself.
ALTER TABLE model_deployments
    ADD COLUMN provider_model_id text NOT NULL DEFAULT '',
    ADD COLUMN source_repository text NOT NULL DEFAULT '',
    ADD COLUMN source_revision text,
    ADD COLUMN source_custom boolean NOT NULL DEFAULT false;
UPDATE model_deployments SET source_repository = model_slug WHERE source_repository = '';
