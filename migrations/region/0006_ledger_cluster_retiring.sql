-- A DI's teardown that found itself the last user of its VPC's cluster marks its cluster entry
-- `retiring` (under a lock per cluster name, see `Store::ledger_cluster_release`) before it
-- deletes the cluster; a converging DI refuses to start using a cluster with a retiring entry
-- (`Store::ledger_cluster_use`) and waits for a cluster of its own. Namespace and node-pool
-- entries now name their cluster by id in `scope` (a cluster name can come back as another
-- cluster); older rows hold the name, which teardown still understands.
ALTER TABLE teardown_ledger ADD COLUMN retiring boolean NOT NULL DEFAULT false;
-- (Not a schema change, a change of meaning: `error` DIs are now claimed for a customer's change
-- they have not seen, such as a revoked token, though still not on a timer; see
-- `Store::work_claim`.)
