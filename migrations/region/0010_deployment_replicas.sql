-- Per model deployment of a DI: the model servers ready now, the replicas the control plane wants
-- (the spec's scale, or the autoscaler's count), and the autoscaler's memory between its looks
-- (NULL for a fixed scale). Rows of deployments a newer spec dropped are removed by the worker.
CREATE TABLE deployment_replicas (
    di_id      uuid NOT NULL REFERENCES dedicated_inferences (id),
    model_id   uuid NOT NULL,
    ready      integer NOT NULL,
    wanted     integer NOT NULL,
    autoscaler jsonb,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (di_id, model_id)
);
