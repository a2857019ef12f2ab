-- The commit a deployment's revision was at when the region accepted it (the Hub's answer for a
-- customer's own repository), so that every replica loads the same weights however the branch
-- moves later. NULL: a catalog model, or a deployment stored before commits were pinned, which
-- loads its revision as it is when a model server starts.
ALTER TABLE model_deployments
    ADD COLUMN source_commit text CHECK (source_commit ~ '^[0-9a-f]{40}$');
