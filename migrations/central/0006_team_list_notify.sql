-- Every committed change to a DI row also names its team, on a channel of its own, so that the
-- central replicas drop that team's cached list (central-store's read_cache module). A channel of
-- its own: replicas of the previous version listen on the first one only and parse its payload
-- as a DI id.
CREATE OR REPLACE FUNCTION dedicated_inferences_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('central_dedicated_inferences', COALESCE(NEW.id, OLD.id)::text);
    PERFORM pg_notify('central_team_lists', COALESCE(NEW.team_id, OLD.team_id)::text);
    IF TG_OP = 'UPDATE' AND NEW.team_id IS DISTINCT FROM OLD.team_id THEN
        PERFORM pg_notify('central_team_lists', OLD.team_id::text);
    END IF;
    RETURN NULL;
END $$;
