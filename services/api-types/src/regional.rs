//! The internal API between central and a regional service. Central authenticates to the region
//! with the region's shared secret; these bodies never reach customers as they are.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::lifecycle::Status;
use crate::spec::{ModelDeployment, Spec};

pub const SECRET_HEADER: &str = "x-region-secret";

/// The `id` of a region's 503 that changed nothing: a dependency it asks before storing (the
/// cloud's VPCs, the Hugging Face Hub) did not answer. Unlike any other 5xx, central knows the
/// call did not take effect.
pub const DEPENDENCY_UNAVAILABLE: &str = "dependency_unavailable";

/// Create a dedicated inference with an id central chose. Retrying with the same id is safe: the
/// region answers with what it already has.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CreateRequest {
    pub id: Uuid,
    pub team_id: Uuid,
    pub spec: Spec,
    pub hugging_face_token: Option<String>,
    /// The managed access token; central keeps the value, the region only its hash.
    pub managed_token: NewToken,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct NewToken {
    pub id: Uuid,
    pub name: String,
    /// Lowercase hex SHA-256 of the token value.
    pub sha256_hex: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PatchRequest {
    pub team_id: Uuid,
    /// Central's id for this operation: applied at most once, a repeat answered with the
    /// current state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<Uuid>,
    pub spec: Option<Spec>,
    pub hugging_face_token: Option<String>,
    /// The spec names a gated model: the region refuses it unless a Hugging Face token is sent
    /// or already stored.
    pub requires_hugging_face_token: bool,
}

/// The query of a DELETE (of a DI or a token).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TeamScoped {
    pub team_id: Uuid,
    /// Central's id for this operation: applied at most once, a repeat (central never heard the
    /// first answer) answered with the current state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<Uuid>,
}

/// The query of a read of one team's things.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TeamQuery {
    pub team_id: Uuid,
}

/// The query of a list: a team's things, a page of them.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    pub team_id: Uuid,
    #[serde(default = "first_page")]
    pub page: i64,
    #[serde(default = "twenty")]
    pub per_page: i64,
    /// Only the accelerators of this model deployment (a list of accelerators only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slug: Option<String>,
}

fn first_page() -> i64 {
    1
}

fn twenty() -> i64 {
    20
}

/// The query of the change feed.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ChangesQuery {
    /// Changes after this sequence number.
    #[serde(default)]
    pub after: i64,
    #[serde(default = "hundred")]
    pub limit: i64,
    /// Hold the request up to this long when nothing changed yet (long poll).
    #[serde(default)]
    pub wait_ms: u64,
}

fn hundred() -> i64 {
    100
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenCreateRequest {
    pub team_id: Uuid,
    /// Central's id for this operation: applied at most once, a repeat answered with the
    /// current state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<Uuid>,
    pub token: NewToken,
}

/// A spec version as stored: the normalised spec plus the version row's identity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StoredSpec {
    pub id: Uuid,
    pub version: i32,
    pub name: String,
    pub region: String,
    pub vpc_uuid: Uuid,
    pub enable_public_endpoint: bool,
    pub model_deployments: Vec<ModelDeployment>,
    pub created_at: DateTime<Utc>,
}

/// Everything the region knows about one dedicated inference, as of outbox position `seq`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Record {
    pub id: Uuid,
    pub team_id: Uuid,
    pub region: String,
    pub vpc_uuid: Uuid,
    pub enable_public_endpoint: bool,
    pub status: Status,
    pub status_reason: Option<String>,
    pub spec: Option<StoredSpec>,
    pub pending_spec: Option<StoredSpec>,
    pub public_endpoint_fqdn: Option<String>,
    pub private_endpoint_fqdn: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// True once every cloud resource is gone: the DI no longer exists for customers.
    pub gone: bool,
    pub seq: i64,
    /// Per model deployment, the model servers ready and the replicas wanted, as the worker
    /// last recorded them (empty until it has).
    #[serde(default)]
    pub replicas: Vec<Replicas>,
}

/// A model deployment's replica counts: ready model servers, and the replicas the control plane
/// wants (the spec's `scale`, or the autoscaler's count within its bounds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Replicas {
    pub model_id: Uuid,
    pub ready: u32,
    pub wanted: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RecordEnvelope {
    pub record: Record,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Changes {
    /// The latest state of each DI changed after the requested position, in `seq` order.
    pub records: Vec<Record>,
    /// Resume from here next time.
    pub last_seq: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Accelerator {
    pub id: Uuid,
    pub name: String,
    pub slug: String,
    pub role: String,
    pub status: String,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Token {
    pub id: Uuid,
    pub name: String,
    pub is_managed: bool,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Event {
    pub id: i64,
    pub phase: String,
    pub reason: String,
    pub message: String,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Page<T> {
    pub items: Vec<T>,
    pub total: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CaCertificate {
    pub cert_pem: String,
}

/// Error body between central and region: a stable `id` central maps to its own error, and a
/// message safe to show a customer.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RegionError {
    pub id: String,
    pub message: String,
}
