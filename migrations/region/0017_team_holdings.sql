-- What each team holds in this region, kept as it changes rather than counted from all of its DIs
-- at every create and patch: that count grew with the team, and ran under the team's lock, so a
-- team with thousands of DIs queued its creates behind it until they timed out.
--
-- A DI holds, while it counts (not gone, not being deleted), one DI and, per size, the more of
-- what its current and its pending spec ask (`di_holdings`). Every change to the columns that
-- decide it appends the difference to `team_holding_changes`, by a trigger deferred to commit, so
-- that it sees the spec versions the transaction stored after the DI's row (a create inserts the
-- DI first). Appending takes no lock that another transaction holds, so a worker completing a
-- rollout never waits for a team's create. A team's create or patch folds its changes into
-- `team_holdings` under the team's lock; what a team holds is its row there plus the changes not
-- yet folded.

-- Creating the trigger waits for every open write on dedicated_inferences, and every write
-- queues behind it meanwhile: give up (the service retries at its next start) rather than stall
-- the region's writes.
SET LOCAL lock_timeout = '5s';

-- The DIs themselves are counted under the empty slug.
CREATE TABLE team_holdings (
    team_id          uuid NOT NULL,
    accelerator_slug text NOT NULL,
    held             bigint NOT NULL,
    PRIMARY KEY (team_id, accelerator_slug)
);

CREATE TABLE team_holding_changes (
    team_id          uuid NOT NULL,
    accelerator_slug text NOT NULL,
    change           bigint NOT NULL
);
CREATE INDEX team_holding_changes_team ON team_holding_changes (team_id);

-- What one DI holds. A deployment holds `scale` replicas, or `autoscaling.max_replicas` when it
-- autoscales (the most the autoscaler may start), of its size's nodes. Specs stored before
-- max_replicas was validated may hold anything there: a fraction counts as the next whole
-- number, a value that is not a number as `scale`, and no value above a million, so that no
-- stored spec can make this (and with it every write to the DI, or this migration) fail. Spec
-- versions are never changed or deleted, so this gives the same answer for a row's old values at
-- any later time; a migration that rewrites a stored version's `scale` or `workload_config`
-- must recount `team_holdings`.
CREATE FUNCTION di_holdings(di uuid, counted boolean, current_version integer, pending_version integer)
RETURNS TABLE (accelerator_slug text, held bigint)
LANGUAGE sql STABLE AS $$
    SELECT '', 1 WHERE counted
    UNION ALL
    SELECT accelerator_slug, max(replicas)::bigint FROM (
        SELECT m.version, g.accelerator_slug,
               sum(CASE WHEN jsonb_typeof(m.workload_config #> '{autoscaling,max_replicas}') = 'number'
                        THEN greatest(g.scale, least(ceil((m.workload_config #>> '{autoscaling,max_replicas}')::numeric), 1000000))
                        ELSE g.scale END) AS replicas
        FROM model_deployments m
        JOIN accelerator_groups g
          ON g.di_id = m.di_id AND g.version = m.version AND g.deployment_position = m.position
        WHERE counted AND m.di_id = di AND m.version IN (current_version, pending_version)
        GROUP BY m.version, g.accelerator_slug) per_version
    GROUP BY accelerator_slug
$$;

CREATE FUNCTION di_holdings_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO team_holding_changes (team_id, accelerator_slug, change)
        SELECT NEW.team_id, h.accelerator_slug, h.held
        FROM di_holdings(NEW.id, NEW.gone_at IS NULL AND NEW.status <> 'deleting',
                         NEW.current_version, NEW.pending_version) h;
    ELSE
        INSERT INTO team_holding_changes (team_id, accelerator_slug, change)
        SELECT NEW.team_id, accelerator_slug, sum(change) FROM (
            SELECT h.accelerator_slug, h.held AS change
            FROM di_holdings(NEW.id, NEW.gone_at IS NULL AND NEW.status <> 'deleting',
                             NEW.current_version, NEW.pending_version) h
            UNION ALL
            SELECT h.accelerator_slug, -h.held
            FROM di_holdings(OLD.id, OLD.gone_at IS NULL AND OLD.status <> 'deleting',
                             OLD.current_version, OLD.pending_version) h) both_sides
        GROUP BY accelerator_slug HAVING sum(change) <> 0;
    END IF;
    RETURN NULL;
END $$;

-- DIs are never deleted (a gone DI stays as a tombstone and holds nothing), nor moved to
-- another team.
CREATE CONSTRAINT TRIGGER di_holdings_changed
    AFTER INSERT OR UPDATE OF status, gone_at, current_version, pending_version ON dedicated_inferences
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION di_holdings_changed();

-- What every team holds now. Creating the trigger above locked out writers to
-- dedicated_inferences until this migration commits, so nothing is counted twice or missed.
INSERT INTO team_holdings (team_id, accelerator_slug, held)
SELECT d.team_id, h.accelerator_slug, sum(h.held)
FROM dedicated_inferences d,
     di_holdings(d.id, d.gone_at IS NULL AND d.status <> 'deleting', d.current_version, d.pending_version) h
GROUP BY d.team_id, h.accelerator_slug;
