//! The public API's bodies, wire-compatible with DigitalOcean's `/v2/dedicated-inferences`.
//!
//! Two client families exist: pydo follows the published spec; godo (doctl, Terraform) spells some
//! fields differently. Requests accept both spellings; responses carry both, since each client
//! ignores the fields it does not know.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::lifecycle::Status;
use crate::regional::{Accelerator, Record, StoredSpec, Token};

// ---------------------------------------------------------------------------------------------
// Requests

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CreateRequest {
    pub spec: SpecInput,
    /// pydo's spelling.
    pub access_tokens: Option<BTreeMap<String, String>>,
    /// godo's spelling of `access_tokens`.
    pub secrets: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct UpdateRequest {
    pub spec: Option<SpecInput>,
    pub access_tokens: Option<ProviderTokens>,
    pub secrets: Option<ProviderTokens>,
}

/// The spec forbids keys other than `hugging_face_token` here.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ProviderTokens {
    pub hugging_face_token: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct SpecInput {
    pub version: i64,
    pub name: String,
    pub region: String,
    pub vpc: Option<VpcRef>,
    /// godo's spelling of `vpc`.
    pub vpc_config: Option<VpcConfig>,
    pub enable_public_endpoint: bool,
    pub model_deployments: Vec<ModelDeploymentInput>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VpcRef {
    pub uuid: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct VpcConfig {
    pub vpc_uuid: String,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ModelDeploymentInput {
    pub model_id: Option<String>,
    pub model_slug: Option<String>,
    /// The provider's id of the model: for `hugging_face`, a Hugging Face repository
    /// (`owner/name`, optionally `@revision`). godo sends `""` when unset.
    pub provider_model_id: Option<String>,
    pub model_provider: Option<String>,
    /// Workload hints (other keys are kept as sent).
    #[schema(value_type = Option<crate::spec::WorkloadConfig>)]
    pub workload_config: Option<serde_json::Value>,
    pub accelerators: Vec<AcceleratorInput>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct AcceleratorInput {
    pub scale: i64,
    #[serde(rename = "type")]
    pub role: String,
    pub accelerator_slug: String,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct TokenCreateRequest {
    pub name: String,
}

// ---------------------------------------------------------------------------------------------
// Responses

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DedicatedInference {
    pub id: Uuid,
    /// godo reads the name at the top level.
    pub name: String,
    pub status: String,
    pub region: String,
    pub vpc_uuid: Uuid,
    pub spec: SpecOutput,
    pub pending_deployment_spec: Option<PendingSpecOutput>,
    pub endpoints: Endpoints,
    /// Per model deployment of the running spec: the model servers ready now and the replicas
    /// the control plane wants (the spec's `scale`, or the autoscaler's count within
    /// `workload_config.autoscaling`). `ready` 0 with `wanted` 0 is a deployment scaled to
    /// zero: its endpoint still takes requests, and the first one starts a replica.
    #[serde(default)]
    pub replicas: Vec<ReplicaCounts>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReplicaCounts {
    pub model_id: String,
    pub model_slug: String,
    pub ready: u32,
    pub wanted: u32,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct Endpoints {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub public_endpoint_fqdn: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub private_endpoint_fqdn: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SpecOutput {
    pub version: i32,
    pub name: String,
    pub region: String,
    pub vpc: VpcRef,
    pub vpc_config: VpcConfig,
    pub enable_public_endpoint: bool,
    pub model_deployments: Vec<ModelDeploymentOutput>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PendingSpecOutput {
    pub id: Uuid,
    pub version: i32,
    pub name: String,
    pub status: String,
    pub vpc: VpcRef,
    pub vpc_config: VpcConfig,
    pub enable_public_endpoint: bool,
    pub model_deployments: Vec<ModelDeploymentOutput>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ModelDeploymentOutput {
    pub model_id: String,
    pub model_slug: String,
    pub provider_model_id: String,
    /// Extension: the Hugging Face commit (40 hex) every model server of the deployment loads,
    /// as the Hub reported it for the revision of `provider_model_id` (or the default branch)
    /// when the create or update that named it was accepted. It stays while updates name the
    /// same repository and revision, even when the branch has moved since; an update that
    /// names another revision (the commit itself, say) moves it. `null` for catalog models and
    /// for deployments accepted before commits were pinned.
    #[serde(default)]
    pub provider_model_commit: Option<String>,
    pub model_provider: String,
    #[schema(value_type = crate::spec::WorkloadConfig)]
    pub workload_config: serde_json::Value,
    pub accelerators: Vec<AcceleratorOutput>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AcceleratorOutput {
    pub scale: i32,
    #[serde(rename = "type")]
    pub role: String,
    pub accelerator_slug: String,
    pub status: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DedicatedInferenceEnvelope {
    pub dedicated_inference: DedicatedInference,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CreateResponse {
    pub dedicated_inference: DedicatedInference,
    pub token: AccessToken,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AccessToken {
    pub id: Uuid,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    pub created_at: DateTime<Utc>,
    pub is_managed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenEnvelope {
    pub token: AccessToken,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AcceleratorInfo {
    pub id: Uuid,
    /// godo's spelling of `id`.
    pub accelerator_id: Uuid,
    pub name: String,
    pub slug: String,
    pub role: String,
    pub status: String,
    /// godo's spelling of `status`.
    pub state: String,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Links {
    pub pages: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Meta {
    pub total: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DedicatedInferenceList {
    pub dedicated_inferences: Vec<DedicatedInference>,
    pub links: Links,
    pub meta: Meta,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AcceleratorList {
    pub accelerators: Vec<AcceleratorInfo>,
    pub links: Links,
    pub meta: Meta,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenList {
    pub tokens: Vec<AccessToken>,
    pub links: Links,
    pub meta: Meta,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CaResponse {
    /// Base64 of the PEM-encoded CA certificates to trust: the DI's CA, and while it is renewed
    /// also its successor (the current one first).
    pub cert: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Size {
    pub gpu_slug: String,
    pub price_per_hour: String,
    pub region: String,
    /// godo reads every region the size is offered in.
    pub regions: Vec<String>,
    pub currency: String,
    pub gpu: SizeGpu,
}

/// The GPUs of one node of a size (godo reads them).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SizeGpu {
    pub count: u32,
    /// Memory per GPU, GB.
    pub vram_gb: u32,
    pub slug: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SizesResponse {
    pub enabled_regions: Vec<String>,
    pub sizes: Vec<Size>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct GpuModelConfig {
    pub gpu_slugs: Vec<String>,
    pub model_slug: String,
    pub model_name: String,
    pub is_gated_model: bool,
    /// godo's spelling of `is_gated_model`.
    pub is_model_gated: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct GpuModelConfigsResponse {
    pub gpu_model_configs: Vec<GpuModelConfig>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EventInfo {
    pub id: i64,
    pub phase: String,
    pub reason: String,
    pub message: String,
    pub time: DateTime<Utc>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EventList {
    pub events: Vec<EventInfo>,
    pub links: Links,
    pub meta: Meta,
}

/// Extension: a team's quotas, per region (`GET /v2/dedicated-inferences/quotas`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct QuotasResponse {
    pub quotas: Vec<RegionQuotas>,
    /// Regions that did not answer just now: their quotas are missing from `quotas`.
    pub unavailable_regions: Vec<String>,
}

/// What a team may hold in one region and what it holds. A dedicated inference counts from its
/// create until it is being deleted; its GPUs are those of its newest accepted spec: per
/// deployment, `scale` (or `workload_config.autoscaling.max_replicas` when it autoscales) × the
/// size's GPUs per node. A create or update that would take a figure above its limit is refused
/// with `422`; one that does not raise it is accepted even above a lowered limit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RegionQuotas {
    pub region: String,
    pub dedicated_inferences: QuotaUse,
    /// GPUs of every size together.
    pub gpus: QuotaUse,
    /// GPUs of each size offered in the region (and of any other size the team holds).
    pub gpus_per_size: Vec<SizeQuotaUse>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct QuotaUse {
    pub limit: u32,
    pub used: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SizeQuotaUse {
    pub accelerator_slug: String,
    pub limit: u32,
    pub used: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub id: String,
    pub message: String,
    pub request_id: String,
}

// ---------------------------------------------------------------------------------------------
// Rendering region records for customers

impl DedicatedInference {
    /// The public view of a region record. `None` for a record that has no spec at all, which the
    /// region never produces for a live DI.
    pub fn from_record(record: &Record) -> Option<DedicatedInference> {
        let shown = record.spec.as_ref().or(record.pending_spec.as_ref())?;
        let accelerator_status = match record.status {
            Status::Active | Status::Updating | Status::Deleting => "active",
            Status::Provisioning => "provisioning",
            Status::New | Status::Error => "new",
        };
        Some(DedicatedInference {
            id: record.id,
            name: shown.name.clone(),
            status: record.status.as_str().to_string(),
            region: record.region.clone(),
            vpc_uuid: record.vpc_uuid,
            spec: SpecOutput {
                version: shown.version,
                name: shown.name.clone(),
                region: shown.region.clone(),
                vpc: vpc_ref(shown.vpc_uuid),
                vpc_config: vpc_config(shown.vpc_uuid),
                enable_public_endpoint: shown.enable_public_endpoint,
                model_deployments: deployments_out(shown, accelerator_status),
            },
            pending_deployment_spec: record.pending_spec.as_ref().map(|p| PendingSpecOutput {
                id: p.id,
                version: p.version,
                name: p.name.clone(),
                status: if record.spec.is_some() {
                    "updating"
                } else {
                    "provisioning"
                }
                .to_string(),
                vpc: vpc_ref(p.vpc_uuid),
                vpc_config: vpc_config(p.vpc_uuid),
                enable_public_endpoint: p.enable_public_endpoint,
                model_deployments: deployments_out(p, "new"),
                created_at: p.created_at,
                updated_at: p.created_at,
            }),
            endpoints: Endpoints {
                public_endpoint_fqdn: record.public_endpoint_fqdn.clone(),
                private_endpoint_fqdn: record.private_endpoint_fqdn.clone(),
            },
            replicas: record
                .spec
                .iter()
                .flat_map(|s| &s.model_deployments)
                .filter_map(|d| {
                    let id = d.model_id?;
                    let r = record.replicas.iter().find(|r| r.model_id == id)?;
                    Some(ReplicaCounts {
                        model_id: id.to_string(),
                        model_slug: d.model_slug.clone(),
                        ready: r.ready,
                        wanted: r.wanted,
                    })
                })
                .collect(),
            created_at: record.created_at,
            updated_at: record.updated_at,
        })
    }
}

fn vpc_ref(uuid: Uuid) -> VpcRef {
    VpcRef {
        uuid: uuid.to_string(),
    }
}

fn vpc_config(uuid: Uuid) -> VpcConfig {
    VpcConfig {
        vpc_uuid: uuid.to_string(),
    }
}

fn deployments_out(spec: &StoredSpec, status: &str) -> Vec<ModelDeploymentOutput> {
    spec.model_deployments
        .iter()
        .map(|d| ModelDeploymentOutput {
            model_id: d.model_id.map(|id| id.to_string()).unwrap_or_default(),
            model_slug: d.model_slug.clone(),
            provider_model_id: d.provider_model_id.clone(),
            provider_model_commit: d.source.commit.clone(),
            model_provider: d.model_provider.clone(),
            workload_config: d.workload_config.clone(),
            accelerators: d
                .accelerators
                .iter()
                .map(|a| AcceleratorOutput {
                    scale: a.scale,
                    role: a.role.clone(),
                    accelerator_slug: a.accelerator_slug.clone(),
                    status: status.to_string(),
                })
                .collect(),
        })
        .collect()
}

impl From<&Accelerator> for AcceleratorInfo {
    fn from(a: &Accelerator) -> Self {
        AcceleratorInfo {
            id: a.id,
            accelerator_id: a.id,
            name: a.name.clone(),
            slug: a.slug.clone(),
            role: a.role.clone(),
            status: a.status.clone(),
            state: a.status.clone(),
            created_at: a.created_at,
        }
    }
}

impl From<&Token> for AccessToken {
    fn from(t: &Token) -> Self {
        AccessToken {
            id: t.id,
            name: t.name.clone(),
            value: None,
            created_at: t.created_at,
            is_managed: t.is_managed,
        }
    }
}
