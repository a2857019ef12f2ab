-- The W3C trace context of the request whose change a worker is carrying out, so that the
-- worker's reconcile passes join the trace of the create, patch, delete or token change that
-- caused them. Cleared when that change is done (active, error or gone).
ALTER TABLE work_items ADD COLUMN traceparent text;
