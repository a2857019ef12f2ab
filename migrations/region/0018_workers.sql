-- The workers of the region, each known by the database session that stands for it while it
-- lives (the session its leases are taken in) and by when it last said it works (`seen_at`,
-- every few seconds). A worker claims only the DIs whose VPC's cluster is its own: of the live
-- workers and itself, the one whose hash of (worker, VPC) is highest (rendezvous hashing). So
-- each cluster is watched by about one worker rather than by every worker that ever took one of
-- its DIs, and a worker that dies, hangs or joins moves only its share.
CREATE TABLE workers (
    worker_id     text PRIMARY KEY,
    pid           integer NOT NULL,
    session_start timestamptz NOT NULL,
    seen_at       timestamptz NOT NULL DEFAULT now()
);
