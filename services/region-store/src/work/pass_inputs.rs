//! What a worker's pass reads besides the DI, in one statement, and the replica counts and
//! autoscaler memory it records.

use sqlx::postgres::PgConnection;
use sqlx::types::Json;
use uuid::Uuid;

use super::ledger::LedgerEntry;
use crate::{
    NewCa, ObservedAccelerator, Result, Store, StoreError, HF_TOKEN, PROBE_TOKEN,
    RETIRED_PROBE_TOKEN,
};

/// What a worker's pass over a converging DI reads besides the DI itself, read at once.
pub struct PassInputs {
    /// The teardown ledger, oldest first.
    pub ledger: Vec<LedgerEntry>,
    /// The accelerators as last recorded, by name.
    pub accelerators: Vec<ObservedAccelerator>,
    /// The DI's CAs in use, the one that expires first first (one, or two while a renewal
    /// overlaps).
    pub cas: Vec<NewCa>,
    /// Live access-token hashes (hex) by token id.
    pub token_hashes: Vec<(Uuid, String)>,
    pub hugging_face_token: Option<String>,
    /// The worker's probe token for this DI (see [`Store::probe_token`]).
    pub probe_token: String,
    /// The one it replaced, which the endpoint must refuse (see [`Store::retired_probe_token`]).
    pub retired_probe_token: Option<String>,
    /// The replica counts and autoscaler memory as last recorded, by model id.
    pub replicas: Vec<DeploymentReplicas>,
    /// The database's clock (milliseconds since the epoch): one clock for every worker.
    pub now_ms: i64,
    /// How long ago the DI's previous pass ended, by any worker (none before its first).
    pub since_last_pass_ms: Option<i64>,
    /// The DI's slot in a fleet rollout, if it has one.
    pub fleet_slot: Option<crate::FleetSlot>,
}

/// A model deployment's replica counts as the worker records them, with the autoscaler's memory
/// between its looks (`None` for a fixed scale). The store keeps the memory as given.
#[derive(Debug, Clone, PartialEq)]
pub struct DeploymentReplicas {
    pub model_id: Uuid,
    pub ready: u32,
    pub wanted: u32,
    pub autoscaler: Option<serde_json::Value>,
}

impl Store {
    /// Everything a converging pass reads besides the DI, over one connection: each separate
    /// checkout would cost a round trip of its own for the pool's release ping.
    pub async fn pass_inputs(&self, di_id: Uuid) -> Result<PassInputs> {
        // One statement: a pass starts with this read, and every resync of a converged DI makes
        // it, so its round trips are a good part of what a resync costs Postgres.
        let row: PassInputsRow = sqlx::query_as(&format!(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms,
                (SELECT (extract(epoch FROM clock_timestamp() - checked_at) * 1000)::bigint
                 FROM work_items WHERE di_id = $1) AS since_last_pass_ms,
                (SELECT coalesce(json_agg(json_build_object('model_id', model_id, 'ready', ready,
                     'wanted', wanted, 'autoscaler', autoscaler) ORDER BY model_id), '[]')
                 FROM deployment_replicas WHERE di_id = $1) AS replicas,
                (SELECT coalesce(json_agg(json_build_object('seq', seq, 'kind', kind, 'name', name,
                     'scope', scope, 'external_id', external_id, 'retiring', retiring) ORDER BY seq), '[]')
                 FROM teardown_ledger WHERE di_id = $1) AS ledger,
                (SELECT coalesce(json_agg(json_build_object('name', name, 'slug', slug, 'role', role,
                     'status', status) ORDER BY name), '[]')
                 FROM accelerators WHERE di_id = $1) AS accelerators,
                (SELECT coalesce(json_agg(json_build_object('cert_pem', cert_pem,
                     'key_sealed', encode(key_sealed, 'hex'),
                     'not_after_us', (extract(epoch FROM not_after) * 1000000)::bigint) ORDER BY not_after), '[]')
                 FROM certificate_authorities WHERE {IN_USE}) AS cas,
                (SELECT coalesce(json_agg(json_build_array(id, encode(token_hash, 'hex')) ORDER BY id), '[]')
                 FROM access_tokens WHERE di_id = $1 AND revoked_at IS NULL) AS token_hashes,
                (SELECT coalesce(json_object_agg(kind, encode(sealed, 'hex')), '{{}}')
                 FROM provider_secrets WHERE di_id = $1 AND kind = ANY($2)) AS secrets,
                (SELECT json_build_object('rendering', rendering, 'canary', canary, 'state', state,
                     'previous', previous, 'started_ms', (extract(epoch FROM started_at) * 1000)::bigint)
                 FROM fleet_slots WHERE di_id = $1) AS fleet_slot",
            IN_USE = crate::authorities::IN_USE
        ))
        .bind(di_id)
        .bind([HF_TOKEN, PROBE_TOKEN, RETIRED_PROBE_TOKEN])
        .fetch_one(&self.pool)
        .await?;
        let secret = |kind: &str| -> Result<Option<String>> {
            let Some(sealed) = row.secrets.0.get(kind) else {
                return Ok(None);
            };
            let sealed = hex::decode(sealed).map_err(|_| StoreError::Seal)?;
            self.open_secret(di_id, kind, &sealed).map(Some)
        };
        let probe_token = match secret(PROBE_TOKEN)? {
            Some(token) => token,
            // The DI's first pass: minted (once, whoever asks first).
            None => self.probe_token(di_id).await?,
        };
        let cas = row
            .cas
            .0
            .into_iter()
            .map(|ca| {
                let key_sealed = hex::decode(&ca.key_sealed).map_err(|_| StoreError::Seal)?;
                let not_after = chrono::DateTime::from_timestamp_micros(ca.not_after_us)
                    .ok_or(StoreError::Seal)?;
                self.open_ca(di_id, ca.cert_pem, &key_sealed, not_after)
            })
            .collect::<Result<Vec<_>>>()?;
        let fleet_slot = row
            .fleet_slot
            .map(|slot| -> Result<crate::FleetSlot> {
                let slot = slot.0;
                Ok(crate::FleetSlot {
                    rendering: slot.rendering,
                    canary: slot.canary,
                    state: crate::fleet::SlotState::parse(&slot.state)?,
                    previous: slot.previous,
                    started_ms: slot.started_ms,
                })
            })
            .transpose()?;
        Ok(PassInputs {
            fleet_slot,
            replicas: row.replicas.0.into_iter().map(Into::into).collect(),
            now_ms: row.now_ms,
            since_last_pass_ms: row.since_last_pass_ms,
            ledger: row.ledger.0,
            accelerators: row.accelerators.0,
            cas,
            token_hashes: row.token_hashes.0,
            hugging_face_token: secret(HF_TOKEN)?,
            probe_token,
            retired_probe_token: secret(RETIRED_PROBE_TOKEN)?,
        })
    }

    /// Records DI `di_id`'s replica counts and autoscaler memory (rows of deployments not in
    /// `rows` go), with an event per scaling decision. A change customers can see (a count, an
    /// event) reaches the change feed; the autoscaler's memory alone does not.
    pub async fn replicas_record(
        &self,
        di_id: Uuid,
        rows: &[DeploymentReplicas],
        events: &[(&str, String)],
    ) -> Result<()> {
        let mut tx = self.pool.begin().await?;
        let row = crate::lock_live(&mut tx, di_id, None).await?;
        self.fence(&mut tx, di_id).await?;
        let before = replicas_on(&mut tx, di_id).await?;
        let visible = |r: &[DeploymentReplicas]| {
            let mut v: Vec<(Uuid, u32, u32)> =
                r.iter().map(|r| (r.model_id, r.ready, r.wanted)).collect();
            v.sort();
            v
        };
        let seen_changed = visible(&before) != visible(rows);
        let ids: Vec<Uuid> = rows.iter().map(|r| r.model_id).collect();
        sqlx::query(
            "DELETE FROM deployment_replicas WHERE di_id = $1 AND NOT (model_id = ANY($2))",
        )
        .bind(di_id)
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
        for r in rows {
            sqlx::query(
                "INSERT INTO deployment_replicas (di_id, model_id, ready, wanted, autoscaler) VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (di_id, model_id) DO UPDATE SET ready = excluded.ready, wanted = excluded.wanted,
                     autoscaler = excluded.autoscaler, updated_at = now()",
            )
            .bind(di_id)
            .bind(r.model_id)
            .bind(i32::try_from(r.ready).unwrap_or(i32::MAX))
            .bind(i32::try_from(r.wanted).unwrap_or(i32::MAX))
            .bind(&r.autoscaler)
            .execute(&mut *tx)
            .await?;
        }
        for (reason, message) in events {
            crate::change(&mut tx, di_id, row.status, reason, message, false).await?;
        }
        if seen_changed && events.is_empty() {
            crate::outbox_only(&mut tx, di_id, "ReplicasChanged").await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// What [`Store::pass_inputs`] reads, in one row.
#[derive(sqlx::FromRow)]
struct PassInputsRow {
    now_ms: i64,
    since_last_pass_ms: Option<i64>,
    replicas: Json<Vec<ReplicasRow>>,
    ledger: Json<Vec<LedgerEntry>>,
    accelerators: Json<Vec<ObservedAccelerator>>,
    cas: Json<Vec<CaRow>>,
    token_hashes: Json<Vec<(Uuid, String)>>,
    /// Sealed secrets (hex) by kind.
    secrets: Json<std::collections::HashMap<String, String>>,
    fleet_slot: Option<Json<FleetSlotRow>>,
}

#[derive(serde::Deserialize)]
struct CaRow {
    cert_pem: String,
    key_sealed: String,
    not_after_us: i64,
}

#[derive(serde::Deserialize)]
struct FleetSlotRow {
    rendering: String,
    canary: bool,
    state: String,
    previous: serde_json::Value,
    started_ms: i64,
}

/// A `deployment_replicas` row as `pass_inputs` reads it (JSON).
#[derive(serde::Deserialize)]
struct ReplicasRow {
    model_id: Uuid,
    ready: i32,
    wanted: i32,
    autoscaler: Option<serde_json::Value>,
}

impl From<ReplicasRow> for DeploymentReplicas {
    fn from(r: ReplicasRow) -> Self {
        DeploymentReplicas {
            model_id: r.model_id,
            ready: r.ready.max(0) as u32,
            wanted: r.wanted.max(0) as u32,
            autoscaler: r.autoscaler,
        }
    }
}

async fn replicas_on(conn: &mut PgConnection, di_id: Uuid) -> Result<Vec<DeploymentReplicas>> {
    let rows: Vec<(Uuid, i32, i32, Option<serde_json::Value>)> = sqlx::query_as(
        "SELECT model_id, ready, wanted, autoscaler FROM deployment_replicas WHERE di_id = $1 ORDER BY model_id",
    )
    .bind(di_id)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(model_id, ready, wanted, autoscaler)| DeploymentReplicas {
            model_id,
            ready: ready.max(0) as u32,
            wanted: wanted.max(0) as u32,
            autoscaler,
        })
        .collect())
}
