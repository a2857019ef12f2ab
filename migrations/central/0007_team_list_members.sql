-- Which DIs a team's list shows, in its order, kept apart from their bodies. A team too large for
-- the replicas' memory (central-store's read_cache) was paged from dedicated_inferences itself:
-- the total and the page's offset visited every one of the team's rows, and those rows change at
-- every status the regions report, so no scan of them stayed index-only. This table changes only
-- when a DI enters or leaves the list or is renamed, so its pages stay all-visible: a page's ids
-- and the total come from its indexes alone, and only the page's bodies are read from
-- dedicated_inferences.
--
-- Listed: live, with the region's view. A trigger in the writing transaction keeps the table; it
-- touches only the row of the DI being written, whose row lock the transaction holds already, so
-- it waits on no one.

-- Creating the triggers waits for every open write on dedicated_inferences, and every write
-- queues behind it meanwhile: give up (the service retries at its next start) rather than stall
-- central's writes.
SET LOCAL lock_timeout = '5s';

CREATE TABLE team_list_members (
    id         uuid PRIMARY KEY,
    team_id    uuid NOT NULL,
    region     text NOT NULL,
    name       text NOT NULL,
    created_at timestamptz NOT NULL
);
CREATE INDEX team_list_members_order ON team_list_members (team_id, created_at, id)
    INCLUDE (region, name);

CREATE FUNCTION team_list_members_keep() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        DELETE FROM team_list_members WHERE id = OLD.id;
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.state = 'live' AND NEW.body IS NOT NULL THEN
        INSERT INTO team_list_members (id, team_id, region, name, created_at)
        VALUES (NEW.id, NEW.team_id, NEW.region, NEW.name, NEW.created_at);
    END IF;
    RETURN NULL;
END $$;

-- Most writes are a region's new view of a listed DI: nothing here changes, and the trigger does
-- not run.
CREATE TRIGGER team_list_members_insert AFTER INSERT ON dedicated_inferences
    FOR EACH ROW WHEN (NEW.state = 'live' AND NEW.body IS NOT NULL)
    EXECUTE FUNCTION team_list_members_keep();
CREATE TRIGGER team_list_members_update AFTER UPDATE ON dedicated_inferences
    FOR EACH ROW WHEN ((OLD.state = 'live' AND OLD.body IS NOT NULL)
                           IS DISTINCT FROM (NEW.state = 'live' AND NEW.body IS NOT NULL)
                       OR ((NEW.state = 'live' AND NEW.body IS NOT NULL)
                           AND (OLD.team_id, OLD.region, OLD.name, OLD.created_at)
                               IS DISTINCT FROM (NEW.team_id, NEW.region, NEW.name, NEW.created_at)))
    EXECUTE FUNCTION team_list_members_keep();
CREATE TRIGGER team_list_members_delete AFTER DELETE ON dedicated_inferences
    FOR EACH ROW WHEN (OLD.state = 'live' AND OLD.body IS NOT NULL)
    EXECUTE FUNCTION team_list_members_keep();

-- The lists as they are. Creating the triggers above locked out writers to dedicated_inferences
-- until this migration commits, so nothing is missed or listed twice.
INSERT INTO team_list_members (id, team_id, region, name, created_at)
SELECT id, team_id, region, name, created_at FROM dedicated_inferences
WHERE state = 'live' AND body IS NOT NULL;
