-- A lease's holder is also known by its database session: the connection a worker keeps open
-- for as long as it lives (`pg_backend_pid()` and its `backend_start`, which tell a reused pid
-- apart). A worker that dies closes its connections, so its session ends at once, and its
-- leases are free from then on rather than when they run out. Leases can therefore be long
-- enough to ride out a stall of the database without a dead worker's DIs waiting as long.
ALTER TABLE work_items ADD COLUMN holder_pid integer, ADD COLUMN holder_session_start timestamptz;
