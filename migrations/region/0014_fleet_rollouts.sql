-- Fleet rollouts: a worker whose rendering would restart model servers of DIs nobody changed (a
-- new image, a new argument) rolls them a few at a time. Each rendering a worker of this region
-- started with is a rollout; only the newest one rolls anything (a worker of an older version
-- still running during an upgrade holds every DI as it is, so two versions never take turns on
-- one DI). An operator pauses and resumes the newest with `regional fleet`.
CREATE TABLE fleet_rollouts (
    rendering  text PRIMARY KEY,
    seq        bigserial UNIQUE,
    state      text NOT NULL DEFAULT 'rolling' CHECK (state IN ('rolling', 'paused', 'halted')),
    -- Why it halted: the canary that failed and its words.
    reason     text,
    started_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- A DI's place in the rollout of a rendering: taken under the budget (canaries first), done once
-- the DI serves the new rendering and answered the probe, failed when it could not (the rollout
-- then halts, and the DI goes back to `previous`, its Deployments' templates before the slot).
CREATE TABLE fleet_slots (
    di_id       uuid PRIMARY KEY REFERENCES dedicated_inferences (id) ON DELETE CASCADE,
    rendering   text NOT NULL REFERENCES fleet_rollouts (rendering) ON DELETE CASCADE,
    canary      boolean NOT NULL,
    state       text NOT NULL CHECK (state IN ('rolling', 'done', 'failed')),
    previous    jsonb NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);
CREATE INDEX fleet_slots_rendering ON fleet_slots (rendering, state);
