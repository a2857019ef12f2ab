//! What customers ask for, through central and the regional service: create, read, change and
//! delete a DI, its tokens and accelerators, each in one transaction with its event and outbox
//! entry; operations central repeats are applied once; the change feed central follows.

use super::*;

impl Store {
    /// Creates the DI with status `new` and pending spec version 1, its managed token, its sealed
    /// Hugging Face token and CA. Idempotent on `req.id`: a retry returns what the first call made.
    pub async fn dedicated_inference_create(
        &self,
        req: &CreateRequest,
        ca: &NewCa,
    ) -> Result<Record> {
        if let Some(existing) = self.dedicated_inference_created(req).await? {
            return Ok(existing);
        }
        let vpc_uuid = req.spec.vpc_uuid.ok_or_else(|| {
            StoreError::Unprocessable(
                "spec.vpc.uuid must be resolved before a create is stored".into(),
            )
        })?;
        let mut tx = self.pool.begin().await?;
        let held = self.quota_before(&mut tx, req.team_id, req.id).await?;
        let inserted = sqlx::query(
            "INSERT INTO dedicated_inferences (id, team_id, region, vpc_uuid, enable_public_endpoint, status, pending_version)
             VALUES ($1, $2, $3, $4, $5, 'new', 1) ON CONFLICT (id) DO NOTHING",
        )
        .bind(req.id)
        .bind(req.team_id)
        .bind(&req.spec.region)
        .bind(vpc_uuid)
        .bind(req.spec.enable_public_endpoint)
        .execute(&mut *tx)
        .await?;
        if inserted.rows_affected() == 0 {
            // A concurrent retry won the race; answer with its result.
            drop(tx);
            return self
                .dedicated_inference_created(req)
                .await?
                .ok_or(StoreError::NotFound);
        }
        let mut spec = req.spec.clone();
        spec.version = 1;
        insert_spec_version(&mut tx, req.id, &spec, &[]).await?;
        sqlx::query(
            "INSERT INTO access_tokens (id, di_id, name, token_hash, is_managed) VALUES ($1, $2, $3, $4, true)",
        )
        .bind(req.managed_token.id)
        .bind(req.id)
        .bind(&req.managed_token.name)
        .bind(token_hash(&req.managed_token)?)
        .execute(&mut *tx)
        .await?;
        if let Some(hf) = &req.hugging_face_token {
            self.put_secret(&mut tx, req.id, HF_TOKEN, hf).await?;
        }
        self.certificate_authority_insert(&mut tx, req.id, ca)
            .await?;
        // Last: the team's lock is held from here to commit.
        self.quota_check(&mut tx, req.team_id, req.id, held).await?;
        requested_change(
            &mut tx,
            req.id,
            Status::New,
            "Created",
            "Dedicated inference accepted; provisioning will start shortly.",
        )
        .await?;
        tx.commit().await?;
        self.record(req.id, None, true).await
    }

    /// The DI an earlier attempt of this create made, if any (`Conflict` when its id is
    /// another team's).
    pub async fn dedicated_inference_created(&self, req: &CreateRequest) -> Result<Option<Record>> {
        match self.record(req.id, None, true).await {
            Ok(record) if record.team_id == req.team_id => Ok(Some(record)),
            Ok(_) => Err(StoreError::Conflict("id already in use".into())),
            Err(StoreError::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The DI as its team sees it; `NotFound` once gone or for another team.
    pub async fn dedicated_inference_get(&self, id: Uuid, team_id: Uuid) -> Result<Record> {
        self.record(id, Some(team_id), false).await
    }

    /// Accepts a new desired spec (and/or a new Hugging Face token). The spec must carry the latest
    /// version the region has; it is stored as version + 1 and supersedes any pending spec.
    pub async fn dedicated_inference_patch(
        &self,
        id: Uuid,
        team_id: Uuid,
        spec: Option<&Spec>,
        hugging_face_token: Option<&str>,
        requires_hugging_face_token: bool,
    ) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        if !self.first_application(&mut tx, id).await? {
            return self.record(id, Some(team_id), true).await;
        }
        // Locks are taken in one order everywhere: the DI's row, then (in the quota check) its
        // team's, then the outbox's.
        let row = lock_live(&mut tx, id, Some(team_id)).await?;
        let held = match spec {
            Some(_) => self.quota_before(&mut tx, team_id, id).await?,
            None => None,
        };
        if !row.status.accepts_changes() {
            return Err(StoreError::Conflict(
                "the dedicated inference is being deleted".into(),
            ));
        }
        if requires_hugging_face_token && hugging_face_token.is_none() {
            let stored: Option<i32> =
                sqlx::query_scalar("SELECT 1 FROM provider_secrets WHERE di_id = $1 AND kind = $2")
                    .bind(id)
                    .bind(HF_TOKEN)
                    .fetch_optional(&mut *tx)
                    .await?;
            if stored.is_none() {
                return Err(StoreError::Unprocessable(
                    "access_tokens.hugging_face_token is required for a gated model".into(),
                ));
            }
        }
        if let Some(spec) = spec {
            let latest = row.pending_version.or(row.current_version).unwrap_or(0);
            if spec.version != latest {
                return Err(StoreError::Conflict(format!(
                    "spec version {} is stale: the current version is {latest}",
                    spec.version
                )));
            }
            if spec.region != row.region {
                return Err(StoreError::Unprocessable(
                    "spec.region cannot be changed".into(),
                ));
            }
            if spec.vpc_uuid.is_some_and(|v| v != row.vpc_uuid) {
                return Err(StoreError::Unprocessable(
                    "spec.vpc.uuid cannot be changed".into(),
                ));
            }
            if spec.enable_public_endpoint != row.enable_public_endpoint {
                return Err(StoreError::Unprocessable(
                    "spec.enable_public_endpoint cannot be changed".into(),
                ));
            }
            let known: Vec<KnownDeployment> = sqlx::query_as(
                "SELECT m.model_id, m.model_slug, m.source_repository, m.source_revision,
                        g.accelerator_slug, g.scale
                 FROM model_deployments m
                 LEFT JOIN LATERAL (SELECT accelerator_slug, scale FROM accelerator_groups g
                     WHERE g.di_id = m.di_id AND g.version = m.version AND g.deployment_position = m.position
                     ORDER BY g.position LIMIT 1) g ON true
                 WHERE m.di_id = $1 AND m.version = $2 ORDER BY m.position",
            )
            .bind(id)
            .bind(latest)
            .fetch_all(&mut *tx)
            .await?;
            let mut next = spec.clone();
            next.version = latest + 1;
            next.vpc_uuid = Some(row.vpc_uuid);
            insert_spec_version(&mut tx, id, &next, &known).await?;
            let status = row
                .status
                .after(Transition::SpecAccepted {
                    rolled_out: row.current_version.is_some(),
                })
                .expect("a DI that accepts changes accepts a spec");
            sqlx::query(
                "UPDATE dedicated_inferences SET pending_version = $2, status = $3, status_reason = NULL, updated_at = now()
                 WHERE id = $1",
            )
            .bind(id)
            .bind(next.version)
            .bind(status.as_str())
            .execute(&mut *tx)
            .await?;
            self.quota_check(&mut tx, team_id, id, held).await?;
            requested_change(
                &mut tx,
                id,
                status,
                "SpecAccepted",
                &format!("Spec version {} accepted.", next.version),
            )
            .await?;
        }
        if let Some(hf) = hugging_face_token {
            self.put_secret(&mut tx, id, HF_TOKEN, hf).await?;
            sqlx::query("UPDATE dedicated_inferences SET updated_at = now() WHERE id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            requested_change(
                &mut tx,
                id,
                row.status,
                "ProviderTokenUpdated",
                "Hugging Face token replaced.",
            )
            .await?;
        }
        tx.commit().await?;
        self.record(id, None, true).await
    }

    /// Moves the DI to `deleting`. Idempotent: deleting a DI that is already deleting changes nothing.
    pub async fn dedicated_inference_delete(&self, id: Uuid, team_id: Uuid) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        if !self.first_application(&mut tx, id).await? {
            return self.record(id, Some(team_id), true).await;
        }
        let row = lock_live(&mut tx, id, Some(team_id)).await?;
        let deleting = row.status.after(Transition::DeleteRequested);
        if deleting != Some(row.status) {
            let deleting = deleting.expect("a delete is always possible");
            sqlx::query(
                "UPDATE dedicated_inferences SET status = $2, status_reason = NULL, updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .bind(deleting.as_str())
            .execute(&mut *tx)
            .await?;
            requested_change(
                &mut tx,
                id,
                deleting,
                "DeleteRequested",
                "Deletion requested; tearing down.",
            )
            .await?;
        }
        tx.commit().await?;
        self.record(id, None, true).await
    }

    /// The latest state of every DI changed after outbox position `after`, oldest change first.
    pub async fn changes_since(&self, after: i64, limit: i64) -> Result<Changes> {
        let batch = self.changed_since(after, limit).await?;
        self.changes_load(batch).await
    }

    /// The first step of [`Store::changes_since`]: which DIs changed after `after`, up to which
    /// outbox position. Public so that a test can commit other changes before the second step.
    pub async fn changed_since(&self, after: i64, limit: i64) -> Result<ChangedBatch> {
        let changed: Vec<(Uuid, i64)> = sqlx::query_as(
            "SELECT di_id, max(seq) AS seq FROM outbox WHERE seq > $1 GROUP BY di_id ORDER BY seq LIMIT $2",
        )
        .bind(after)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        let last_seq = changed.iter().map(|(_, seq)| *seq).max().unwrap_or(after);
        Ok(ChangedBatch {
            ids: changed.into_iter().map(|(id, _)| id).collect(),
            last_seq: last_seq.max(after),
        })
    }

    /// The second step of [`Store::changes_since`]: each changed DI's record as it is now. The
    /// cursor stays where the batch ended even when a record is newer: a change of another DI
    /// committed between the two steps sits below such a record's `seq`, and moving the cursor
    /// past it would lose it. A record newer than the cursor only comes again next time.
    pub async fn changes_load(&self, batch: ChangedBatch) -> Result<Changes> {
        let mut records = Vec::with_capacity(batch.ids.len());
        for id in batch.ids {
            records.push(self.record(id, None, true).await?);
        }
        Ok(Changes {
            records,
            last_seq: batch.last_seq,
        })
    }

    /// The newest outbox position, for consumers that start from "now".
    pub async fn outbox_head(&self) -> Result<i64> {
        Ok(
            sqlx::query_scalar("SELECT coalesce(max(seq), 0) FROM outbox")
                .fetch_one(&self.pool)
                .await?,
        )
    }

    pub async fn accelerators_list(
        &self,
        id: Uuid,
        team_id: Uuid,
        slug: Option<&str>,
        page: i64,
        per_page: i64,
    ) -> Result<Page<Accelerator>> {
        self.ensure_visible(id, team_id).await?;
        let rows: Vec<records::AcceleratorRow> = sqlx::query_as(
            "SELECT id, name, slug, role, status, created_at, count(*) OVER () AS total FROM accelerators
             WHERE di_id = $1 AND ($2::text IS NULL OR slug = $2) ORDER BY created_at, name LIMIT $3 OFFSET $4",
        )
        .bind(id)
        .bind(slug)
        .bind(per_page)
        .bind((page - 1) * per_page)
        .fetch_all(&self.pool)
        .await?;
        let total = match rows.first() {
            Some(r) => r.total,
            None => sqlx::query_scalar(
                "SELECT count(*) FROM accelerators WHERE di_id = $1 AND ($2::text IS NULL OR slug = $2)",
            )
            .bind(id)
            .bind(slug)
            .fetch_one(&self.pool)
            .await?,
        };
        Ok(Page {
            items: rows.into_iter().map(Into::into).collect(),
            total,
        })
    }

    pub async fn accelerator_get(
        &self,
        id: Uuid,
        team_id: Uuid,
        accelerator_id: Uuid,
    ) -> Result<Accelerator> {
        self.ensure_visible(id, team_id).await?;
        let row: Option<records::AcceleratorRow> = sqlx::query_as(
            "SELECT id, name, slug, role, status, created_at, 1::bigint AS total FROM accelerators WHERE di_id = $1 AND id = $2",
        )
        .bind(id)
        .bind(accelerator_id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(Into::into).ok_or(StoreError::NotFound)
    }

    pub async fn tokens_list(
        &self,
        id: Uuid,
        team_id: Uuid,
        page: i64,
        per_page: i64,
    ) -> Result<Page<Token>> {
        self.ensure_visible(id, team_id).await?;
        let rows: Vec<(Uuid, String, bool, chrono::DateTime<chrono::Utc>, i64)> = sqlx::query_as(
            "SELECT id, name, is_managed, created_at, count(*) OVER () FROM access_tokens
             WHERE di_id = $1 AND revoked_at IS NULL ORDER BY created_at, id LIMIT $2 OFFSET $3",
        )
        .bind(id)
        .bind(per_page)
        .bind((page - 1) * per_page)
        .fetch_all(&self.pool)
        .await?;
        let total =
            match rows.first() {
                Some(r) => r.4,
                None => sqlx::query_scalar(
                    "SELECT count(*) FROM access_tokens WHERE di_id = $1 AND revoked_at IS NULL",
                )
                .bind(id)
                .fetch_one(&self.pool)
                .await?,
            };
        let items = rows
            .into_iter()
            .map(|(id, name, is_managed, created_at, _)| Token {
                id,
                name,
                is_managed,
                created_at,
            })
            .collect();
        Ok(Page { items, total })
    }

    /// Adds an access token (by hash). Idempotent on the token id.
    pub async fn token_create(&self, id: Uuid, team_id: Uuid, token: &NewToken) -> Result<Token> {
        let mut tx = self.pool.begin().await?;
        if !self.first_application(&mut tx, id).await? {
            return self.token(id, token.id).await;
        }
        let row = lock_live(&mut tx, id, Some(team_id)).await?;
        if !row.status.accepts_changes() {
            return Err(StoreError::Conflict(
                "the dedicated inference is being deleted".into(),
            ));
        }
        let created: Option<(chrono::DateTime<chrono::Utc>,)> = sqlx::query_as(
            "INSERT INTO access_tokens (id, di_id, name, token_hash, is_managed) VALUES ($1, $2, $3, $4, false)
             ON CONFLICT (id) DO NOTHING RETURNING created_at",
        )
        .bind(token.id)
        .bind(id)
        .bind(&token.name)
        .bind(token_hash(token)?)
        .fetch_optional(&mut *tx)
        .await?;
        if created.is_some() {
            requested_change(
                &mut tx,
                id,
                row.status,
                "TokenCreated",
                &format!("Access token {} created.", token.name),
            )
            .await?;
        }
        tx.commit().await?;
        self.token(id, token.id).await
    }

    async fn token(&self, id: Uuid, token_id: Uuid) -> Result<Token> {
        let (name, is_managed, created_at): (String, bool, chrono::DateTime<chrono::Utc>) =
            sqlx::query_as("SELECT name, is_managed, created_at FROM access_tokens WHERE id = $1 AND di_id = $2")
                .bind(token_id)
                .bind(id)
                .fetch_optional(&self.pool)
                .await?
                .ok_or_else(|| StoreError::Conflict("token id already in use".into()))?;
        Ok(Token {
            id: token_id,
            name,
            is_managed,
            created_at,
        })
    }

    pub async fn token_revoke(&self, id: Uuid, team_id: Uuid, token_id: Uuid) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        if !self.first_application(&mut tx, id).await? {
            return Ok(());
        }
        let row = lock_live(&mut tx, id, Some(team_id)).await?;
        if !row.status.accepts_changes() {
            return Err(StoreError::Conflict(
                "the dedicated inference is being deleted".into(),
            ));
        }
        let revoked = sqlx::query(
            "UPDATE access_tokens SET revoked_at = now() WHERE id = $1 AND di_id = $2 AND revoked_at IS NULL",
        )
        .bind(token_id)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        if revoked.rows_affected() == 0 {
            return Err(StoreError::NotFound);
        }
        requested_change(
            &mut tx,
            id,
            row.status,
            "TokenRevoked",
            &format!("Access token {token_id} revoked."),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records this store's operation in `tx`, which applies it; false when the operation was
    /// already applied (a repeat, or a concurrent copy that committed first), and always true
    /// without an operation. A transaction that fails rolls the record back with the operation.
    async fn first_application(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        id: Uuid,
    ) -> Result<bool> {
        let Some(operation) = self.operation else {
            return Ok(true);
        };
        let recorded = sqlx::query(
            "INSERT INTO applied_operations (operation_id, di_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        )
        .bind(operation)
        .bind(id)
        .execute(&mut **tx)
        .await?;
        Ok(recorded.rows_affected() == 1)
    }

    /// Whether this store's operation (see [`Store::for_operation`]) was applied already: its
    /// repetition is answered with the DI as it is, without asking anything again.
    pub async fn operation_applied(&self) -> Result<bool> {
        let Some(operation) = self.operation else {
            return Ok(false);
        };
        Ok(
            sqlx::query("SELECT 1 FROM applied_operations WHERE operation_id = $1")
                .bind(operation)
                .fetch_optional(&self.pool)
                .await?
                .is_some(),
        )
    }

    /// Forgets operations applied more than `age` ago; central repeats one for at most a day.
    pub async fn applied_operations_purge(&self, age: std::time::Duration) -> Result<u64> {
        Ok(sqlx::query(
            "DELETE FROM applied_operations WHERE created_at < now() - make_interval(secs => $1)",
        )
        .bind(age.as_secs_f64())
        .execute(&self.pool)
        .await?
        .rows_affected())
    }

    pub async fn events_list(
        &self,
        id: Uuid,
        team_id: Uuid,
        page: i64,
        per_page: i64,
    ) -> Result<Page<Event>> {
        self.ensure_visible(id, team_id).await?;
        let items: Vec<Event> = sqlx::query_as::<_, (i64, String, String, String, chrono::DateTime<chrono::Utc>)>(
            "SELECT id, phase, reason, message, created_at FROM events WHERE di_id = $1 ORDER BY id LIMIT $2 OFFSET $3",
        )
        .bind(id)
        .bind(per_page)
        .bind((page - 1) * per_page)
        .fetch_all(&self.pool)
        .await?
        .into_iter()
        .map(|(id, phase, reason, message, created_at)| Event { id, phase, reason, message, created_at })
        .collect();
        let total = sqlx::query_scalar("SELECT count(*) FROM events WHERE di_id = $1")
            .bind(id)
            .fetch_one(&self.pool)
            .await?;
        Ok(Page { items, total })
    }
}
