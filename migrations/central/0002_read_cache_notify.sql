-- Every committed change to an ownership/read-model row tells the central replicas which id to
-- drop from their in-process read caches (central-store's read_cache module).
CREATE FUNCTION dedicated_inferences_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('central_dedicated_inferences', COALESCE(NEW.id, OLD.id)::text);
    RETURN NULL;
END $$;

CREATE TRIGGER dedicated_inferences_notify
    AFTER INSERT OR UPDATE OR DELETE ON dedicated_inferences
    FOR EACH ROW EXECUTE FUNCTION dedicated_inferences_notify();
