-- A DI whose Kubernetes objects changed behind its worker's back (seen by a cluster watch) is
-- made due at once. While a pass holds it, that pass may have looked before the change: `woken`
-- says so, and the release then makes the DI due at once rather than at the pass's next check.
ALTER TABLE work_items ADD COLUMN woken boolean NOT NULL DEFAULT false;
