//! Assembling a `Record` (a DI with its current and pending spec versions) from its rows.

use api_types::lifecycle::Status;
use api_types::regional::{Accelerator, Record, Replicas, StoredSpec};
use chrono::{DateTime, Utc};
use sqlx::postgres::PgPool;
use sqlx::types::Json;
use uuid::Uuid;

use crate::{Result, StoreError};

#[derive(sqlx::FromRow)]
struct DiRow {
    id: Uuid,
    team_id: Uuid,
    region: String,
    vpc_uuid: Uuid,
    enable_public_endpoint: bool,
    status: String,
    status_reason: Option<String>,
    current_version: Option<i32>,
    pending_version: Option<i32>,
    public_endpoint_fqdn: Option<String>,
    private_endpoint_fqdn: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    gone: bool,
    seq: i64,
    /// The current and the pending spec version, as JSON in `StoredSpec`'s shape.
    specs: Json<Vec<StoredSpec>>,
    replicas: Json<Vec<Replicas>>,
}

#[derive(sqlx::FromRow)]
pub(crate) struct AcceleratorRow {
    id: Uuid,
    name: String,
    slug: String,
    role: String,
    status: String,
    created_at: DateTime<Utc>,
    pub(crate) total: i64,
}

impl From<AcceleratorRow> for Accelerator {
    fn from(r: AcceleratorRow) -> Self {
        Accelerator {
            id: r.id,
            name: r.name,
            slug: r.slug,
            role: r.role,
            status: r.status,
            created_at: r.created_at,
        }
    }
}

pub(crate) async fn load(
    pool: &PgPool,
    id: Uuid,
    team_id: Option<Uuid>,
    include_gone: bool,
) -> Result<Record> {
    // One statement for the row and both spec versions (every caller, from a GET to a worker's
    // pass, needs them together): each separate query would cost a round trip and the pool's
    // release ping.
    let row: DiRow = sqlx::query_as(
        "SELECT id, team_id, region, vpc_uuid, enable_public_endpoint, status, status_reason, current_version,
                pending_version, public_endpoint_fqdn, private_endpoint_fqdn, created_at, updated_at,
                gone_at IS NOT NULL AS gone,
                coalesce((SELECT max(seq) FROM outbox WHERE di_id = d.id), 0) AS seq,
                (SELECT coalesce(json_agg(json_build_object(
                     'id', s.id, 'version', s.version, 'name', s.name, 'region', d.region,
                     'vpc_uuid', s.vpc_uuid, 'enable_public_endpoint', s.enable_public_endpoint,
                     'created_at', s.created_at,
                     'model_deployments', (
                         SELECT coalesce(json_agg(json_build_object(
                             'model_id', m.model_id, 'model_slug', m.model_slug,
                             'model_provider', m.model_provider, 'provider_model_id', m.provider_model_id,
                             'source', json_build_object('repository', m.source_repository,
                                 'revision', m.source_revision, 'custom', m.source_custom,
                                 'commit', m.source_commit),
                             'workload_config', m.workload_config,
                             'accelerators', (
                                 SELECT coalesce(json_agg(json_build_object(
                                     'accelerator_slug', g.accelerator_slug, 'role', g.role, 'scale', g.scale)
                                     ORDER BY g.position), '[]')
                                 FROM accelerator_groups g
                                 WHERE g.di_id = m.di_id AND g.version = m.version
                                   AND g.deployment_position = m.position))
                             ORDER BY m.position), '[]')
                         FROM model_deployments m WHERE m.di_id = s.di_id AND m.version = s.version))), '[]')
                 FROM spec_versions s
                 WHERE s.di_id = d.id AND s.version IN (d.current_version, d.pending_version)) AS specs,
                (SELECT coalesce(json_agg(json_build_object(
                     'model_id', r.model_id, 'ready', r.ready, 'wanted', r.wanted) ORDER BY r.model_id), '[]')
                 FROM deployment_replicas r WHERE r.di_id = d.id) AS replicas
         FROM dedicated_inferences d
         WHERE id = $1 AND ($2::uuid IS NULL OR team_id = $2) AND ($3 OR gone_at IS NULL)",
    )
    .bind(id)
    .bind(team_id)
    .bind(include_gone)
    .fetch_optional(pool)
    .await?
    .ok_or(StoreError::NotFound)?;
    let mut specs = row.specs.0;
    let pending_spec = row
        .pending_version
        .and_then(|v| specs.iter().position(|s| s.version == v))
        .map(|i| specs.remove(i));
    let spec = row
        .current_version
        .and_then(|v| specs.into_iter().find(|s| s.version == v));
    Ok(Record {
        id: row.id,
        team_id: row.team_id,
        region: row.region,
        vpc_uuid: row.vpc_uuid,
        enable_public_endpoint: row.enable_public_endpoint,
        status: parse_status(&row.status)?,
        status_reason: row.status_reason,
        spec,
        pending_spec,
        public_endpoint_fqdn: row.public_endpoint_fqdn,
        private_endpoint_fqdn: row.private_endpoint_fqdn,
        created_at: row.created_at,
        updated_at: row.updated_at,
        gone: row.gone,
        seq: row.seq,
        replicas: row.replicas.0,
    })
}

/// A status column read back: always one of the lifecycle's, since only this crate writes it.
pub(crate) fn parse_status(text: &str) -> Result<Status> {
    text.parse()
        .map_err(|e| StoreError::Database(sqlx::Error::Decode(Box::new(e))))
}
