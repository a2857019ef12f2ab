//! What a worker's pass records: each method moves one DI forward in one transaction with its
//! event and outbox entry, under the pass's lease (see `Store::under_lease`); and the secrets a
//! pass needs, opened for it.

use super::*;

impl Store {
    /// `new` → `provisioning`. A no-op in any other status.
    pub async fn provisioning_begin(&self, id: Uuid) -> Result<Record> {
        self.transition(
            id,
            Transition::ProvisioningStarted,
            "ProvisioningStarted",
            "Provisioning cloud resources.",
        )
        .await
    }

    /// `active` → `updating`, for a pending spec a worker starts rolling out. A no-op otherwise.
    pub async fn updating_begin(&self, id: Uuid) -> Result<Record> {
        self.transition(
            id,
            Transition::RolloutStarted,
            "RolloutStarted",
            "Rolling out a new spec.",
        )
        .await
    }

    /// The pending spec `version` is fully rolled out: it becomes current, the pending spec is
    /// cleared and the DI is `active`. If a newer spec superseded it meanwhile, nothing changes
    /// (the worker converges on the newer one next) and `Conflict` says so.
    pub async fn rollout_complete(
        &self,
        id: Uuid,
        version: i32,
        endpoints: &Endpoints,
    ) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        let Some(active) = row.status.after(Transition::RolloutComplete) else {
            return Err(StoreError::Conflict(format!(
                "a dedicated inference in status {} is not rolling out",
                row.status
            )));
        };
        if row.pending_version != Some(version) {
            return Err(StoreError::Conflict(format!(
                "version {version} is not the pending spec"
            )));
        }
        sqlx::query(
            "UPDATE dedicated_inferences SET current_version = $2, pending_version = NULL, status = $5,
                 status_reason = NULL, public_endpoint_fqdn = $3, private_endpoint_fqdn = $4, updated_at = now()
             WHERE id = $1",
        )
        .bind(id)
        .bind(version)
        .bind(&endpoints.public_fqdn)
        .bind(&endpoints.private_fqdn)
        .bind(active.as_str())
        .execute(&mut *tx)
        .await?;
        final_change(
            &mut tx,
            id,
            active,
            "RolloutComplete",
            &format!("Spec version {version} is serving."),
        )
        .await?;
        tx.commit().await?;
        self.record(id, None, true).await
    }

    /// The endpoints of an active DI moved (the cloud replaced a load balancer, or the cluster
    /// was rebuilt): the new addresses are recorded, with an event. A no-op when they are the
    /// ones recorded or the DI is not active (a rollout records them when it completes).
    pub async fn endpoints_update(&self, id: Uuid, endpoints: &Endpoints) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        let moved = sqlx::query(
            "UPDATE dedicated_inferences SET public_endpoint_fqdn = $2, private_endpoint_fqdn = $3, updated_at = now()
             WHERE id = $1 AND status = 'active'
               AND (public_endpoint_fqdn, private_endpoint_fqdn) IS DISTINCT FROM ($2, $3)",
        )
        .bind(id)
        .bind(&endpoints.public_fqdn)
        .bind(&endpoints.private_fqdn)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if moved {
            let shown = |e: &Option<String>| e.clone().unwrap_or_else(|| "none".into());
            let message = format!(
                "The endpoints moved: public {}, private {}.",
                shown(&endpoints.public_fqdn),
                shown(&endpoints.private_fqdn)
            );
            change(
                &mut tx,
                id,
                Status::Active,
                "EndpointsChanged",
                &message,
                false,
            )
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// A permanent failure: status `error` with a reason, until the spec changes. `version` is
    /// the spec the failing pass was rolling out: when a newer one was accepted meanwhile, the
    /// failure is about a spec nobody wants any more and nothing changes (the next pass tries
    /// the newer one). `None` fails the DI whatever its spec (a stall). Not applied to a DI
    /// being deleted (deletion wins), nor again for the same reason.
    pub async fn error_set(
        &self,
        id: Uuid,
        version: Option<i32>,
        reason: &str,
        message: &str,
    ) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        let heading_for = row.pending_version.or(row.current_version);
        let superseded = version.is_some_and(|v| Some(v) != heading_for);
        let repeated = row.status == Status::Error && row.status_reason.as_deref() == Some(reason);
        if let Some(failed) = row
            .status
            .after(Transition::Failed)
            .filter(|_| !superseded && !repeated)
        {
            sqlx::query(
                "UPDATE dedicated_inferences SET status = $3, status_reason = $2, updated_at = now() WHERE id = $1",
            )
            .bind(id)
            .bind(reason)
            .bind(failed.as_str())
            .execute(&mut *tx)
            .await?;
            final_change(&mut tx, id, failed, reason, message).await?;
        }
        tx.commit().await?;
        self.record(id, None, true).await
    }

    /// Every cloud resource is gone: the DI disappears for customers (404 from now on).
    pub async fn gone(&self, id: Uuid) -> Result<Record> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        let Some(status) = row.status.after(Transition::Gone) else {
            return Err(StoreError::Conflict(
                "only a dedicated inference being deleted can be gone".into(),
            ));
        };
        sqlx::query(
            "UPDATE dedicated_inferences SET gone_at = now(), updated_at = now() WHERE id = $1",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE access_tokens SET revoked_at = now() WHERE di_id = $1 AND revoked_at IS NULL",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?;
        // Its secrets go with it: the Hugging Face token, the probe credential, the CA keys
        // (teardown, now finished, was the last thing that could need them). The record stays.
        sqlx::query("DELETE FROM provider_secrets WHERE di_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM certificate_authorities WHERE di_id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        final_change(
            &mut tx,
            id,
            status,
            "Deleted",
            "Every cloud resource is gone.",
        )
        .await?;
        tx.commit().await?;
        self.record(id, None, true).await
    }

    /// Records a progress or warning event without changing status.
    pub async fn event_append(&self, id: Uuid, reason: &str, message: &str) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        change(&mut tx, id, row.status, reason, message, false).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Replaces the observed accelerators with what the worker saw; ids stay stable by name.
    pub async fn accelerators_replace(
        &self,
        id: Uuid,
        observed: &[ObservedAccelerator],
    ) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        lock_live(&mut tx, id, None).await?;
        self.fence(&mut tx, id).await?;
        let names: Vec<String> = observed.iter().map(|a| a.name.clone()).collect();
        sqlx::query("DELETE FROM accelerators WHERE di_id = $1 AND NOT (name = ANY($2))")
            .bind(id)
            .bind(&names)
            .execute(&mut *tx)
            .await?;
        for a in observed {
            sqlx::query(
                "INSERT INTO accelerators (id, di_id, name, slug, role, status) VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (di_id, name) DO UPDATE SET slug = excluded.slug, role = excluded.role, status = excluded.status
                 WHERE (accelerators.slug, accelerators.role, accelerators.status) IS DISTINCT FROM (excluded.slug, excluded.role, excluded.status)",
            )
            .bind(Uuid::new_v4())
            .bind(id)
            .bind(&a.name)
            .bind(&a.slug)
            .bind(&a.role)
            .bind(&a.status)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The Hugging Face token, unsealed, for the worker that writes it into the cluster.
    pub async fn hugging_face_token(&self, id: Uuid) -> Result<Option<String>> {
        let mut conn = self.pool.acquire().await?;
        self.hugging_face_token_on(&mut conn, id).await
    }

    /// Hashes (hex) of the DI's live access tokens, keyed by token id: what the gateway checks.
    pub async fn token_hashes(&self, id: Uuid) -> Result<Vec<(Uuid, String)>> {
        let mut conn = self.pool.acquire().await?;
        token_hashes_on(&mut conn, id).await
    }

    /// The worker's probe token of DI `id`, unsealed: the credential with which workers check
    /// that the DI's endpoint answers before they declare it active. Made on first use (a random
    /// token, sealed like the other secrets; concurrent workers agree on the first one stored),
    /// valid for this DI only (its hash is written with this DI's access tokens), replaced by
    /// [`Store::probe_token_rotate`] and deleted when the DI is gone.
    pub async fn probe_token(&self, id: Uuid) -> Result<String> {
        let mut conn = self.pool.acquire().await?;
        self.probe_token_on(&mut conn, id).await
    }

    /// The probe token DI `id` had before its last rotation, if it was ever rotated.
    pub async fn retired_probe_token(&self, id: Uuid) -> Result<Option<String>> {
        let mut conn = self.pool.acquire().await?;
        self.secret_on(&mut conn, id, RETIRED_PROBE_TOKEN).await
    }

    pub(crate) async fn probe_token_on(&self, conn: &mut PgConnection, id: Uuid) -> Result<String> {
        if let Some(token) = self.secret_on(conn, id, PROBE_TOKEN).await? {
            return Ok(token);
        }
        let minted = common::tokens::mint("di_");
        // Only for a live DI, and never behind the back of [`Store::gone`], which erases the
        // DI's secrets: the lock waits for a concurrent `gone` and then sees the DI gone.
        sqlx::query(
            "INSERT INTO provider_secrets (di_id, kind, sealed)
             SELECT id, $2, $3 FROM dedicated_inferences WHERE id = $1 AND gone_at IS NULL FOR KEY SHARE
             ON CONFLICT (di_id, kind) DO NOTHING",
        )
        .bind(id)
        .bind(PROBE_TOKEN)
        .bind(
            self.sealer
                .seal(minted.as_bytes(), secret_aad(id, PROBE_TOKEN).as_bytes()),
        )
        .execute(&mut *conn)
        .await?;
        self.secret_on(conn, id, PROBE_TOKEN)
            .await?
            .ok_or(StoreError::NotFound)
    }

    /// Replaces DI `id`'s probe token (e.g. when it may have leaked): the next pass writes the
    /// new one's hash in place of the old one's, so the old one stops working within seconds,
    /// in any status in which the endpoint serves. The old one is kept as the retired probe
    /// token ([`Store::retired_probe_token`]): a token the endpoint accepted once and must
    /// refuse now, which the probe checks.
    pub async fn probe_token_rotate(&self, id: Uuid) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let row = lock_live(&mut tx, id, None).await?;
        if !row.status.accepts_changes() {
            return Err(StoreError::Conflict(
                "the dedicated inference is being deleted".into(),
            ));
        }
        if let Some(old) = self.secret_on(&mut tx, id, PROBE_TOKEN).await? {
            self.put_secret(&mut tx, id, RETIRED_PROBE_TOKEN, &old)
                .await?;
        }
        self.put_secret(&mut tx, id, PROBE_TOKEN, &common::tokens::mint("di_"))
            .await?;
        requested_change(
            &mut tx,
            id,
            row.status,
            "ProbeTokenRotated",
            "The control plane's endpoint probe credential was replaced.",
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }
}
