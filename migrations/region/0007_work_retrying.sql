-- `retrying`: the last pass over the DI failed transiently and is to be tried again at
-- `next_check_after`, whatever the DI's status. Without it an `error` DI (not looked at on a
-- timer) whose pass for a customer's change failed — a revoked token that could not be written
-- to its cluster yet — was never tried again.
ALTER TABLE work_items ADD COLUMN retrying boolean NOT NULL DEFAULT false;
