-- A pending create or a keyed operation is sent to its region by one driver at a time (the
-- request, the customer's retry, recovery, on any replica). A region's answer that it changed
-- nothing speaks for one attempt only: the create or operation is over only if no other attempt
-- of it is in flight, which `driven_until` (how long the current driver's attempt may last)
-- tells.
ALTER TABLE pending_creates ADD COLUMN driven_until timestamptz;
ALTER TABLE idempotency_keys ADD COLUMN driven_until timestamptz;
