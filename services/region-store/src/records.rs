//! Assembling a `Record` (a DI with its current and pending spec versions) from its rows.

use api_types::regional::{Accelerator, Record, StoredSpec};
use api_types::spec::{AcceleratorGroup, ModelDeployment};
use chrono::{DateTime, Utc};
use sqlx::postgres::PgPool;
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
    let row: DiRow = sqlx::query_as(
        "SELECT id, team_id, region, vpc_uuid, enable_public_endpoint, status, status_reason, current_version,
                pending_version, public_endpoint_fqdn, private_endpoint_fqdn, created_at, updated_at,
                gone_at IS NOT NULL AS gone,
                coalesce((SELECT max(seq) FROM outbox WHERE di_id = d.id), 0) AS seq
         FROM dedicated_inferences d
         WHERE id = $1 AND ($2::uuid IS NULL OR team_id = $2) AND ($3 OR gone_at IS NULL)",
    )
    .bind(id)
    .bind(team_id)
    .bind(include_gone)
    .fetch_optional(pool)
    .await?
    .ok_or(StoreError::NotFound)?;
    let versions: Vec<i32> = row
        .current_version
        .into_iter()
        .chain(row.pending_version)
        .collect();
    let mut specs = load_specs(pool, id, &row.region, &versions).await?;
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
        status: row.status,
        status_reason: row.status_reason,
        spec,
        pending_spec,
        public_endpoint_fqdn: row.public_endpoint_fqdn,
        private_endpoint_fqdn: row.private_endpoint_fqdn,
        created_at: row.created_at,
        updated_at: row.updated_at,
        gone: row.gone,
        seq: row.seq,
    })
}

async fn load_specs(
    pool: &PgPool,
    id: Uuid,
    region: &str,
    versions: &[i32],
) -> Result<Vec<StoredSpec>> {
    if versions.is_empty() {
        return Ok(Vec::new());
    }
    let heads: Vec<(i32, Uuid, String, bool, Uuid, DateTime<Utc>)> = sqlx::query_as(
        "SELECT version, id, name, enable_public_endpoint, vpc_uuid, created_at FROM spec_versions
         WHERE di_id = $1 AND version = ANY($2)",
    )
    .bind(id)
    .bind(versions)
    .fetch_all(pool)
    .await?;
    let deployments: Vec<(i32, i32, Uuid, String, String, serde_json::Value)> = sqlx::query_as(
        "SELECT version, position, model_id, model_slug, model_provider, workload_config FROM model_deployments
         WHERE di_id = $1 AND version = ANY($2) ORDER BY version, position",
    )
    .bind(id)
    .bind(versions)
    .fetch_all(pool)
    .await?;
    let groups: Vec<(i32, i32, String, String, i32)> = sqlx::query_as(
        "SELECT version, deployment_position, accelerator_slug, role, scale FROM accelerator_groups
         WHERE di_id = $1 AND version = ANY($2) ORDER BY version, deployment_position, position",
    )
    .bind(id)
    .bind(versions)
    .fetch_all(pool)
    .await?;
    Ok(heads
        .into_iter()
        .map(
            |(version, spec_id, name, enable_public_endpoint, vpc_uuid, created_at)| StoredSpec {
                id: spec_id,
                version,
                name,
                region: region.to_string(),
                vpc_uuid,
                enable_public_endpoint,
                model_deployments: deployments
                    .iter()
                    .filter(|d| d.0 == version)
                    .map(
                        |(_, position, model_id, model_slug, model_provider, workload_config)| {
                            ModelDeployment {
                                model_id: Some(*model_id),
                                model_slug: model_slug.clone(),
                                model_provider: model_provider.clone(),
                                workload_config: workload_config.clone(),
                                accelerators: groups
                                    .iter()
                                    .filter(|g| g.0 == version && g.1 == *position)
                                    .map(|(_, _, slug, role, scale)| AcceleratorGroup {
                                        accelerator_slug: slug.clone(),
                                        role: role.clone(),
                                        scale: *scale,
                                    })
                                    .collect(),
                            }
                        },
                    )
                    .collect(),
                created_at,
            },
        )
        .collect())
}
