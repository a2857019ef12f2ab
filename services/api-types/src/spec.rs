//! The normalised desired state of a dedicated inference, as central sends it to a region and as
//! the region stores it (one immutable row set per version).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use uuid::Uuid;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Spec {
    pub version: i32,
    pub name: String,
    pub region: String,
    /// `None` when the request names no VPC: on a create the team's default VPC in the region
    /// (the regional service fills it in before storing), on a patch the DI's own.
    pub vpc_uuid: Option<Uuid>,
    pub enable_public_endpoint: bool,
    pub model_deployments: Vec<ModelDeployment>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelDeployment {
    /// `None` on input means "a new deployment"; the region assigns an id.
    pub model_id: Option<Uuid>,
    pub model_slug: String,
    pub model_provider: String,
    #[schema(value_type = Object)]
    pub workload_config: serde_json::Value,
    pub accelerators: Vec<AcceleratorGroup>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct AcceleratorGroup {
    pub accelerator_slug: String,
    /// The accelerator's role, `type` on the public wire (e.g. `prefill_decode`).
    pub role: String,
    pub scale: i32,
}
