-- Recovery backs off per create: failed attempts so far, and when to try again (NULL: as soon as
-- it is old enough).
ALTER TABLE pending_creates
    ADD COLUMN attempts integer NOT NULL DEFAULT 0,
    ADD COLUMN retry_at timestamptz;
