-- A DI's CA now expires and is renewed before it does: while a renewal overlaps, the DI has two
-- (the old one still signing, the new one already published by `GET …/ca`). `not_after` is when
-- the control plane stops using one; an expired CA is deleted once a newer one exists.
ALTER TABLE certificate_authorities DROP CONSTRAINT certificate_authorities_pkey;
ALTER TABLE certificate_authorities
    ADD COLUMN id bigserial PRIMARY KEY,
    ADD COLUMN not_after timestamptz;
-- CAs made before this ran until the year 4096 without name constraints. They end a year from
-- now (the default renewal window): renewal gives each DI a constrained CA at once, customers
-- have that year to fetch it, and then the old one is retired and its key erased.
UPDATE certificate_authorities SET not_after = now() + interval '365 days';
ALTER TABLE certificate_authorities ALTER COLUMN not_after SET NOT NULL;
CREATE INDEX certificate_authorities_di ON certificate_authorities (di_id, not_after);
